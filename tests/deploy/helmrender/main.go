// helmrender renders a Helm chart the way `helm template` does, for checking the chart in
// deploy/helm without Helm (not packaged in Debian): Go's text/template with the sprig
// function library (Debian's golang-github-masterminds-sprig-dev, the library Helm uses)
// plus Helm's own functions include, tpl, required, fail, toYaml, fromYaml and toJson;
// .Values (values.yaml deep-merged with each -f file, later files winning), .Release,
// .Chart and .Template; templates whose names start with "_" define helpers and render
// nothing. Writes the rendered manifests as one multi-document YAML stream, each document
// headed by "# Source: <chart>/templates/<file>" as Helm writes it.
//
//	helmrender [-f values.yaml]... [-name RELEASE] [-namespace NS] CHART_DIR
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	"gopkg.in/yaml.v3"
)

type valueFiles []string

func (v *valueFiles) String() string     { return strings.Join(*v, ",") }
func (v *valueFiles) Set(s string) error { *v = append(*v, s); return nil }

func readYAML(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	return out, nil
}

// merge deep-merges src into dst (maps merge key by key; anything else is replaced).
func merge(dst, src map[string]interface{}) map[string]interface{} {
	for k, v := range src {
		if sm, ok := v.(map[string]interface{}); ok {
			if dm, ok := dst[k].(map[string]interface{}); ok {
				dst[k] = merge(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
	return dst
}

func toYAML(v interface{}) string {
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return ""
	}
	return strings.TrimSuffix(b.String(), "\n")
}

func main() {
	var files valueFiles
	flag.Var(&files, "f", "values file (repeatable; later files win)")
	name := flag.String("name", "release", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: helmrender [-f values.yaml]... [-name R] [-namespace NS] CHART_DIR")
		os.Exit(2)
	}
	chartDir := flag.Arg(0)
	fail := func(format string, args ...interface{}) {
		fmt.Fprintf(os.Stderr, "helmrender: "+format+"\n", args...)
		os.Exit(1)
	}

	chart, err := readYAML(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		fail("%v", err)
	}
	values, err := readYAML(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		fail("%v", err)
	}
	for _, f := range files {
		extra, err := readYAML(f)
		if err != nil {
			fail("%v", err)
		}
		values = merge(values, extra)
	}
	chartName, _ := chart["name"].(string)
	// Helm's .Chart fields are capitalised (.Chart.Name, .Chart.AppVersion).
	chartObj := map[string]interface{}{}
	for k, v := range chart {
		chartObj[strings.ToUpper(k[:1])+k[1:]] = v
	}

	paths, _ := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	sort.Strings(paths)
	root := template.New("chart")
	funcs := sprig.TxtFuncMap()
	funcs["include"] = func(name string, data interface{}) (string, error) {
		var b bytes.Buffer
		err := root.ExecuteTemplate(&b, name, data)
		return b.String(), err
	}
	funcs["tpl"] = func(text string, data interface{}) (string, error) {
		t, err := root.Clone()
		if err != nil {
			return "", err
		}
		t, err = t.New("tpl").Parse(text)
		if err != nil {
			return "", err
		}
		var b bytes.Buffer
		err = t.Execute(&b, data)
		return b.String(), err
	}
	funcs["required"] = func(msg string, v interface{}) (interface{}, error) {
		if v == nil || v == "" {
			return nil, fmt.Errorf("%s", msg)
		}
		return v, nil
	}
	funcs["fail"] = func(msg string) (string, error) { return "", fmt.Errorf("%s", msg) }
	funcs["toYaml"] = toYAML
	funcs["fromYaml"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		_ = yaml.Unmarshal([]byte(s), &m)
		return m
	}
	root.Funcs(funcs).Option("missingkey=zero")
	var rendered []string
	for _, p := range paths {
		base := filepath.Base(p)
		if strings.HasSuffix(base, ".txt") {
			continue // NOTES.txt: shown after install, not a manifest
		}
		text, err := os.ReadFile(p)
		if err != nil {
			fail("%v", err)
		}
		if _, err := root.New(chartName + "/templates/" + base).Parse(string(text)); err != nil {
			fail("%v", err)
		}
		if !strings.HasPrefix(base, "_") {
			rendered = append(rendered, base)
		}
	}
	var out bytes.Buffer
	for _, base := range rendered {
		tname := chartName + "/templates/" + base
		data := map[string]interface{}{
			"Values":  values,
			"Chart":   chartObj,
			"Release": map[string]interface{}{"Name": *name, "Namespace": *namespace, "Service": "Helm", "IsInstall": true},
			"Template": map[string]interface{}{"Name": tname, "BasePath": chartName + "/templates"},
			"Capabilities": map[string]interface{}{},
		}
		var b bytes.Buffer
		if err := root.ExecuteTemplate(&b, tname, data); err != nil {
			fail("%v", err)
		}
		doc := strings.TrimSpace(strings.ReplaceAll(b.String(), "<no value>", ""))
		if doc == "" {
			continue
		}
		fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", tname, doc)
	}
	os.Stdout.Write(out.Bytes())
}
