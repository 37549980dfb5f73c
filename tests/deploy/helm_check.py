"""Checks a rendered kvshade chart (helmrender output) for what the schemas cannot see:

    helm_check.py RENDERED.yaml KVSHADE_SERVER OUT.json [GPUS]

- the objects are a ConfigMap, a DaemonSet, a Service and (when on) a ServiceMonitor,
  with the DaemonSet's selector matching its pods and the Service's selector;
- the pod runs one daemon container, or GPUS (gpusPerNode > 1) containers, container i
  on backend cuda:i with every GPU visible in PCI bus order (NVIDIA_VISIBLE_DEVICES=all,
  CUDA_DEVICE_ORDER=PCI_BUS_ID); no two containers share a port, a ConfigMap key, a
  backend or a spill path;
- each container's probes dial its own gRPC port (grpc.health.v1, or the kvshade CLI with
  TLS), and the ports it declares are those its configuration serves (listen, metrics_port);
- every volumeMount names a volume; the Service exposes every container port (and nothing
  else); the ServiceMonitor scrapes every metrics port of the Service with job label
  app.kubernetes.io/name (job="kvshade", as the alert rules expect), and with several
  daemons each endpoint labels its series with the daemon's gpu;
- each container's kvshade.yaml (the ConfigMap key it mounts) is accepted by the real
  daemon (`kvshade-server --check-config`), with /etc/kvshade/ mapped to a directory holding
  exactly the files the pod mounts there (so every file the config names is mounted),
  /var/lib/kvshade to a directory shared by the containers as the state volume is, and the
  container's KVSHADE_* variables set as in the pod; the settings the daemon reports
  (listen, backend, metrics, spill) are the ones compared;
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
    volumes = {v["name"]: v for v in pod["volumes"]}
    containers = pod["containers"]
    gpus = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if len(containers) != gpus:
        errors.append("%d containers, expected %d" % (len(containers), gpus))
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    exposed = set()  # container port names the Service targets
    for p in svc["spec"]["ports"]:
        exposed.add(p["targetPort"])
    seen = {}  # (what, value) -> container, for what must differ between containers
    with tempfile.TemporaryDirectory(prefix="kvshade-helm-check-") as tmp:
        state = os.path.join(tmp, "var-lib-kvshade")  # the state volume, shared by the pod
        os.makedirs(state)
        for i, c in enumerate(containers):
            errors += check_container(c, i, gpus, volumes, cm, exposed, svc_ports, server, tmp, state, seen)
    for name in svc_ports:
        if svc_ports[name]["targetPort"] not in {p["name"] for c in containers for p in c["ports"]}:
            errors.append("Service port %s targets no container port" % name)
    if "ServiceMonitor" in by_kind:
        sm = by_kind["ServiceMonitor"]["spec"]
        if sm.get("jobLabel") != "app.kubernetes.io/name" or svc["metadata"]["labels"].get("app.kubernetes.io/name") != "kvshade":
            errors.append("the ServiceMonitor does not give job=kvshade")
        scraped, gpu_labels = set(), []
        for e in sm["endpoints"]:
            if e["port"] not in svc_ports:
                errors.append("ServiceMonitor scrapes port %s, not a port of the Service" % e["port"])
            scraped.add(e["port"])
            labels = [r.get("replacement") for r in e.get("relabelings", []) if r.get("targetLabel") == "gpu"]
            gpu_labels += labels
        metrics_ports = {n for n in svc_ports if n.startswith("metrics")}
        if scraped != metrics_ports:
            errors.append("ServiceMonitor scrapes %s, the Service's metrics ports are %s" % (sorted(scraped), sorted(metrics_ports)))
        want = [str(i) for i in range(gpus)] if gpus > 1 else []
        if sorted(gpu_labels, key=int) != want:
            errors.append("ServiceMonitor gpu labels %s, expected %s" % (gpu_labels, want))
    json.dump(docs, open(out, "w"))
    for e in errors:
        print("FAIL:", e)
    if not errors:
        print("helm_check: %s OK (%s)" % (os.path.basename(rendered), ", ".join(sorted(by_kind))))
    return 1 if errors else 0


def check_container(c, i, gpus, volumes, cm, exposed, svc_ports, server, tmp, state, seen):
    """The checks of one daemon container; returns its errors."""
    errors = []
    name = c["name"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    grpc_name, metrics_name = ("grpc", "metrics") if gpus == 1 else ("grpc-%d" % i, "metrics-%d" % i)
    if set(ports) != {grpc_name, metrics_name}:
        errors.append("%s: ports %s, expected %s and %s" % (name, sorted(ports), grpc_name, metrics_name))
        return errors
    for pname, port in ports.items():
        if pname not in exposed:
            errors.append("%s: port %s is not exposed by the Service" % (name, pname))
        elif svc_ports[pname]["port"] != port:
            errors.append("%s: Service port %s is %s, the container's %s" % (name, pname, svc_ports[pname]["port"], port))
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    if gpus > 1:
        if env.get("NVIDIA_VISIBLE_DEVICES") != "all" or env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            errors.append("%s: GPUs not all visible in PCI bus order (NVIDIA_VISIBLE_DEVICES=%s, CUDA_DEVICE_ORDER=%s)"
                          % (name, env.get("NVIDIA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER")))
        if "CUDA_VISIBLE_DEVICES" in env:
            errors.append("%s: CUDA_VISIBLE_DEVICES renumbers the GPUs" % name)
    for probe in ("livenessProbe", "readinessProbe"):
        p = c.get(probe)
        if p is None:
            errors.append("%s: no %s" % (name, probe))
        elif "grpc" in p:
            if p["grpc"]["port"] != ports[grpc_name]:
                errors.append("%s: %s dials port %s, the container serves gRPC on %s" % (name, probe, p["grpc"]["port"], ports[grpc_name]))
        elif "exec" in p:
            cmd = p["exec"]["command"]
            if cmd[0] != "kvshade" or "status" not in cmd or "127.0.0.1:%d" % ports[grpc_name] not in cmd:
                errors.append("%s: %s runs %s" % (name, probe, cmd))
        else:
            errors.append("%s: %s is neither grpc nor the kvshade CLI" % (name, probe))
    for m in c["volumeMounts"]:
        if m["name"] not in volumes:
            errors.append("%s: volumeMount %s names no volume" % (name, m["name"]))
    if errors:
        return errors

    # The container's configuration (the ConfigMap key it mounts) through the real daemon.
    cfg_mounts = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/kvshade/kvshade.yaml"]
    if len(cfg_mounts) != 1 or "configMap" not in volumes[cfg_mounts[0]["name"]] or cfg_mounts[0].get("subPath") not in cm["data"]:
        return ["%s: /etc/kvshade/kvshade.yaml is not one key of the ConfigMap" % name]
    key = cfg_mounts[0]["subPath"]
    etc = os.path.join(tmp, name, "etc")
    os.makedirs(etc)
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
            for k in ("tls.crt", "tls.key", "ca.crt"):
                open(os.path.join(local, k), "w").write("placeholder\n")
    if not any(m["mountPath"] == "/var/lib/kvshade" for m in c["volumeMounts"]):
        errors.append("%s: the state volume is not mounted at /var/lib/kvshade" % name)

    def local_path(text):
        return text.replace("/etc/kvshade/", etc + "/").replace("/var/lib/kvshade", state)

    cfg_path = os.path.join(tmp, name, "kvshade.yaml")
    open(cfg_path, "w").write(local_path(cm["data"][key]))
    run_env = {"PATH": "/usr/bin:/bin"}
    for e in c.get("env", []):
        if e["name"].startswith("KVSHADE_"):
            run_env[e["name"]] = local_path(e.get("value", "secret-from-a-kubernetes-secret"))
    r = subprocess.run([server, "--config", cfg_path, "--check-config"], env=run_env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    text = r.stdout.decode()
    if r.returncode != 0 or "configuration OK" not in text:
        return errors + ["%s: kvshade-server --check-config refuses ConfigMap key %s:\n%s" % (name, key, text)]
    # The settings as the daemon resolved them, from its log line "config: listen=...
    # backend=... spill=... metrics=..." (text, or the msg of a JSON log line).
    got = {}
    for line in text.splitlines():
        if line.startswith("{"):
            line = json.loads(line).get("msg", "")
        if "config: " in line:
            got = dict(w.split("=", 1) for w in line.split("config: ", 1)[1].split() if "=" in w)
    if got.get("spill", "off") != "off" and not got["spill"].startswith(state + "/"):
        errors.append("%s: spill tier %s is not on the state volume" % (name, got["spill"]))
    want_backend = "cuda:%d" % i if gpus > 1 else None
    if want_backend and got.get("backend") != want_backend:
        errors.append("%s: backend %s, expected %s" % (name, got.get("backend"), want_backend))
    if got.get("listen", "").rsplit(":", 1)[-1] != str(ports[grpc_name]):
        errors.append("%s: the daemon listens on %s, the container declares %s" % (name, got.get("listen"), ports[grpc_name]))
    if got.get("metrics", "").rsplit(":", 1)[-1] != str(ports[metrics_name]):
        errors.append("%s: /metrics on %s, the container declares %s" % (name, got.get("metrics"), ports[metrics_name]))
    for what in ("listen", "metrics", "backend", "spill"):
        v = got.get(what)
        if v is None:
            errors.append("%s: --check-config reports no %s" % (name, what))
        elif v not in ("off", "auto", "cpu") and (what, v) in seen:
            errors.append("%s: %s %s is also %s's" % (name, what, v, seen[(what, v)]))
        else:
            seen[(what, v)] = name
    if (("key", key)) in seen:
        errors.append("%s: ConfigMap key %s is also %s's" % (name, key, seen[("key", key)]))
    seen[("key", key)] = name
    return errors


if __name__ == "__main__":
    sys.exit(main())
