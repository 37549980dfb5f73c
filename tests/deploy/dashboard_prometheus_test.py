"""The Grafana dashboard and the Prometheus rules against a real Prometheus scraping a live
kvshade-server under a small workload.

    dashboard_prometheus_test.py SOURCE_DIR KVSHADE_SERVER KVSHADE_CLI

Starts kvshade-server (CPU backend, spill tier on, /metrics on a free port), starts
Debian's `prometheus` scraping it every second with deploy/prometheus/kvshade-rules.yml
loaded, runs `kvshade demo` (a small document-QA workload) twice, scrapes apart, and one
call that fails (NOT_FOUND), then checks that
  - every metric name the dashboard and the rules use is one the daemon exports (its
    /metrics, as scraped);
  - Prometheus loaded the rule file (its /api/v1/rules lists every group);
  - every query of every dashboard panel returns at least one finite sample
    ($__rate_interval as 1m, $instance as .*).
Without prometheus installed it prints SKIPPED and exits 77 (ctest reports it skipped).
"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

SKIP = 77


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def query(prom, expr):
    url = "http://%s/api/v1/query?%s" % (prom, urllib.parse.urlencode({"query": expr}))
    body = json.loads(get(url))
    if body.get("status") != "success":
        raise RuntimeError("query %r: %s" % (expr, body))
    return body["data"]["result"]


def wait_for(what, fn, timeout):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.25)
    raise RuntimeError("timed out waiting for %s (last error: %s)" % (what, last))


def scraped_after(prom, t):
    """Waits until Prometheus holds a scrape of the daemon taken after time t (and one more,
    so that a rate() over the last samples sees what happened before t)."""
    for _ in range(2):
        wait_for("a scrape after %.1f" % t, lambda: any(
            float(s["value"][1]) > t for s in query(prom, 'timestamp(up{job="kvshade"})')), 60)
        t = time.time()


def metric_names(text):
    """kvshade_* and process_* names in PromQL or JSON text, histogram suffixes removed."""
    names = set()
    for n in re.findall(r"\b((?:kvshade|process)_[a-z0-9_]+)", text):
        if n.startswith("kvshade_") and n.count("_") == 0:
            continue
        names.add(re.sub(r"_(bucket|sum|count)$", "", n))
    return names


def main():
    src, server_bin, cli = sys.argv[1:4]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("SKIPPED: prometheus is not installed (Debian package `prometheus`; "
              "scripts/install-deps.sh installs it)")
        return SKIP
    dashboard = json.load(open(os.path.join(src, "deploy/grafana/kvshade.json")))
    rules_file = os.path.join(src, "deploy/prometheus/kvshade-rules.yml")

    tmp = tempfile.mkdtemp(prefix="kvshade-dash-test-")
    procs = []
    server_log = open(os.path.join(tmp, "server.log"), "w+")
    prom_log = open(os.path.join(tmp, "prometheus.log"), "w+")
    try:
        metrics_port, prom_port = free_port(), free_port()
        env = dict(os.environ, OMP_WAIT_POLICY="passive", OMP_NUM_THREADS="2")
        port_file = os.path.join(tmp, "port")
        procs.append(subprocess.Popen(
            [server_bin, "--listen", "127.0.0.1:0", "--port-file", port_file, "--backend", "cpu",
             "--metrics-port", str(metrics_port), "--spill-path", os.path.join(tmp, "spill")],
            stdout=server_log, stderr=subprocess.STDOUT, env=env))
        wait_for("kvshade-server's port file", lambda: os.path.exists(port_file), 30)
        target = "127.0.0.1:%s" % open(port_file).read().strip()

        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "rule_files:\n  - %s\n"
                    "scrape_configs:\n  - job_name: kvshade\n    static_configs:\n"
                    "      - targets: ['127.0.0.1:%d']\n" % (rules_file, metrics_port))
        prom = "127.0.0.1:%d" % prom_port
        procs.append(subprocess.Popen(
            [prometheus, "--config.file", os.path.join(tmp, "prometheus.yml"),
             "--storage.tsdb.path", os.path.join(tmp, "tsdb"), "--web.listen-address", prom],
            stdout=prom_log, stderr=subprocess.STDOUT))
        wait_for("prometheus to scrape the daemon",
                 lambda: any(s["value"][1] == "1" for s in query(prom, 'up{job="kvshade"}')), 60)

        # The workload: a small document-QA run (ingest, prefix reuse, select, attend) and a
        # call that fails.
        # Twice, scrapes apart: a series is born at its first observation, so rate() and the
        # latency quantiles need a second round of calls after Prometheus has seen it.
        for _ in range(2):
            demo = subprocess.run(
                [cli, "--target", target, "demo", "--doc-tokens", "2048", "--layers", "2",
                 "--questions", "3", "--steps", "6", "--no-ucx", "--no-progress", "--wait", "30"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=120)
            if demo.returncode != 0:
                raise RuntimeError("kvshade demo failed (%d):\n%s" % (demo.returncode, demo.stdout.decode()))
            scraped_after(prom, time.time())
        missing = subprocess.run([cli, "--target", target, "sessions", "info", "no-such-session"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=30)
        if missing.returncode == 0:
            raise RuntimeError("sessions info of an unknown session succeeded")
        scraped_after(prom, time.time())
        if not query(prom, 'kvshade_rpc_total{job="kvshade",code="NOT_FOUND"}'):
            raise RuntimeError("the failed call is not in Prometheus")

        failures = []
        # 1. Every metric name used is exported by the daemon.
        scraped = get("http://127.0.0.1:%d/metrics" % metrics_port)
        exported = set(re.findall(r"^# TYPE (\S+) ", scraped, re.M))
        used = metric_names(json.dumps(dashboard)) | metric_names(open(rules_file).read())
        for name in sorted(used - exported):
            failures.append("%s is used by the dashboard or the rules but not exported" % name)

        # 2. Prometheus loaded every rule group.
        groups = {g["name"] for g in json.loads(get("http://%s/api/v1/rules" % prom))["data"]["groups"]}
        for g in ("kvshade.recording", "kvshade.alerts"):
            if g not in groups:
                failures.append("rule group %s not loaded by Prometheus (loaded: %s)" % (g, sorted(groups)))

        # 3. Every panel query returns data.
        checked = 0
        for panel in dashboard["panels"]:
            for t in panel.get("targets", []):
                expr = t["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
                result = query(prom, expr)
                values = [float(s["value"][1]) for s in result]
                checked += 1
                if not any(math.isfinite(v) for v in values):
                    failures.append("panel %r query %s returned %s" % (panel["title"], t["refId"],
                                                                       values or "no series"))
        for f in failures:
            print("FAIL:", f)
        if failures:
            server_log.seek(0)
            print("--- server log (tail) ---\n" + server_log.read()[-3000:])
            return 1
        print("dashboard_prometheus_test: OK: %d panel queries over %d panels returned data; "
              "%d metric names checked against /metrics; rule groups loaded"
              % (checked, sum(1 for p in dashboard["panels"] if p.get("targets")), len(used)))
        return 0
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
