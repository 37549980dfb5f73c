// Validates Kubernetes objects (a JSON array, argv[2]) against the OpenAPI schemas of
// Kubernetes and prometheus-operator that the npm packages kubernetes-models and
// @kubernetes-models/prometheus-operator ship (ajv underneath). Prints one line per object;
// exits 1 if any object is invalid or of a kind without a schema here.
import fs from "node:fs";
import { DaemonSet } from "kubernetes-models/apps/v1/DaemonSet";
import { ConfigMap } from "kubernetes-models/v1/ConfigMap";
import { Service } from "kubernetes-models/v1/Service";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const models = { "apps/v1 DaemonSet": DaemonSet, "v1 ConfigMap": ConfigMap, "v1 Service": Service,
                 "monitoring.coreos.com/v1 ServiceMonitor": ServiceMonitor };
let bad = 0;
for (const doc of JSON.parse(fs.readFileSync(process.argv[2], "utf8"))) {
  const kind = `${doc.apiVersion} ${doc.kind}`;
  const Model = models[kind];
  if (!Model) {
    console.log(`INVALID ${kind}: no schema here`);
    bad++;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`valid ${kind} ${doc.metadata.name}`);
  } catch (e) {
    console.log(`INVALID ${kind} ${doc.metadata.name}: ${e.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
