"""Checks a rendered kvshade chart (helmrender output) for what the schemas cannot see:

    helm_check.py RENDERED.yaml KVSHADE_SERVER OUT.json

- the objects are a ConfigMap, a DaemonSet, a Service and (when on) a ServiceMonitor,
  with the DaemonSet's selector matching its pods and the Service's selector;
- the probes dial the container's gRPC port (grpc.health.v1, or the kvshade CLI with TLS);
- every volumeMount names a volume; the ServiceMonitor scrapes the Service's metrics port
  with job label app.kubernetes.io/name (job="kvshade", as the alert rules expect);
- the ConfigMap's kvshade.yaml is accepted by the real daemon (`kvshade-server
  --check-config`), with /etc/kvshade/ mapped to a directory holding exactly the files the
  pod mounts there (so every file the config names is mounted) and the pod's KVSHADE_*
  variables set as in the pod;
and writes the objects as a JSON array (OUT.json) for the schema validation.
"""
import json
import os
import subprocess
import sys
import tempfile

import yaml


def main():
    rendered, server, out = sys.argv[1:4]
    docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
    by_kind = {d["kind"]: d for d in docs}
    errors = []
    for kind in ("ConfigMap", "DaemonSet", "Service"):
        if kind not in by_kind:
            errors.append("no %s rendered" % kind)
    if errors:
        print("\n".join(errors))
        return 1
    ds, svc, cm = by_kind["DaemonSet"], by_kind["Service"], by_kind["ConfigMap"]
    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    for k, v in ds["spec"]["selector"]["matchLabels"].items():
        if labels.get(k) != v:
            errors.append("DaemonSet selector %s=%s does not match its pods" % (k, v))
    for k, v in svc["spec"]["selector"].items():
        if labels.get(k) != v:
            errors.append("Service selector %s=%s does not match the pods" % (k, v))
    c = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        p = c.get(probe)
        if p is None:
            errors.append("no %s" % probe)
        elif "grpc" in p:
            if p["grpc"]["port"] != ports["grpc"]:
                errors.append("%s dials port %s, the container serves gRPC on %s" % (probe, p["grpc"]["port"], ports["grpc"]))
        elif "exec" in p:
            cmd = p["exec"]["command"]
            if cmd[0] != "kvshade" or "status" not in cmd or "127.0.0.1:%d" % ports["grpc"] not in cmd:
                errors.append("%s runs %s" % (probe, cmd))
        else:
            errors.append("%s is neither grpc nor the kvshade CLI" % probe)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in c["volumeMounts"]:
        if m["name"] not in volumes:
            errors.append("volumeMount %s names no volume" % m["name"])
    if "ServiceMonitor" in by_kind:
        sm = by_kind["ServiceMonitor"]["spec"]
        if sm.get("jobLabel") != "app.kubernetes.io/name" or svc["metadata"]["labels"].get("app.kubernetes.io/name") != "kvshade":
            errors.append("the ServiceMonitor does not give job=kvshade")
        svc_ports = {p["name"] for p in svc["spec"]["ports"]}
        for e in sm["endpoints"]:
            if e["port"] not in svc_ports:
                errors.append("ServiceMonitor scrapes port %s, not a port of the Service" % e["port"])

    # The ConfigMap's configuration through the real daemon.
    with tempfile.TemporaryDirectory(prefix="kvshade-helm-check-") as tmp:
        etc = os.path.join(tmp, "etc")
        for m in c["volumeMounts"]:
            path = m["mountPath"]
            if not path.startswith("/etc/kvshade/") or path == "/etc/kvshade/kvshade.yaml":
                continue
            local = os.path.join(etc, path[len("/etc/kvshade/"):])
            vol = volumes[m["name"]]
            if "subPath" in m:  # one file of a Secret
                os.makedirs(os.path.dirname(local), exist_ok=True)
                open(local, "w").write("token-of-%s-0123456789\n" % m["name"])
            elif "secret" in vol:  # a kubernetes.io/tls Secret: its keys
                os.makedirs(local, exist_ok=True)
                for key in ("tls.crt", "tls.key", "ca.crt"):
                    open(os.path.join(local, key), "w").write("placeholder\n")
        config = cm["data"]["kvshade.yaml"].replace("/etc/kvshade/", etc + "/")
        cfg_path = os.path.join(tmp, "kvshade.yaml")
        open(cfg_path, "w").write(config)
        env = {"PATH": "/usr/bin:/bin"}
        for e in c.get("env", []):
            if e["name"].startswith("KVSHADE_"):
                env[e["name"]] = e.get("value", "secret-from-a-kubernetes-secret")
        env["KVSHADE_SPILL_PATH"] = os.path.join(tmp, "spill")  # /var/lib/kvshade is the pod's
        r = subprocess.run([server, "--config", cfg_path, "--check-config"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        text = r.stdout.decode()
        if r.returncode != 0 or "configuration OK" not in text:
            errors.append("kvshade-server --check-config refuses the ConfigMap's kvshade.yaml:\n" + text)
    json.dump(docs, open(out, "w"))
    for e in errors:
        print("FAIL:", e)
    if not errors:
        print("helm_check: %s OK (%s)" % (os.path.basename(rendered), ", ".join(sorted(by_kind))))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
