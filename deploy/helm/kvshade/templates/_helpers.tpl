{{/* Names and labels shared by the templates. */}}
{{- define "kvshade.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvshade.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvshade.labels" -}}
{{ include "kvshade.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The probe command: grpc.health.v1 through the kvshade CLI, with TLS when it is on.
Argument: (dict "root" $ "port" <the daemon's gRPC port>). */}}
{{- define "kvshade.probeExec" -}}
{{- $v := .root.Values -}}
exec:
  command:
    - kvshade
    - --target
    - {{ printf "127.0.0.1:%v" .port | quote }}
    - --tls
    - --ca
    - /etc/kvshade/tls/ca.crt
    {{- with $v.tls.serverName }}
    - --server-name
    - {{ . | quote }}
    {{- end }}
    {{- if $v.tls.requireClientCert }}
    - --cert
    - /etc/kvshade/tls/tls.crt
    - --key
    - /etc/kvshade/tls/tls.key
    {{- end }}
    - status
    - --wait
    - "2"
{{- end -}}


{{/* One daemon serving every GPU of the node (deploy/README.md "One daemon for every GPU"):
backend cuda:all or a list of devices ("cuda:0,cuda:1"). "true" or "". */}}
{{- define "kvshade.allGpus" -}}
{{- $b := toString .Values.backend -}}
{{- if or (eq $b "cuda:all") (contains "," $b) -}}true{{- end -}}
{{- end -}}

{{/* Daemons per pod: gpusPerNode, checked. */}}
{{- define "kvshade.daemonCount" -}}
{{- $n := int .Values.gpusPerNode -}}
{{- if lt $n 1 -}}
{{- fail (printf "gpusPerNode must be at least 1, got %v" .Values.gpusPerNode) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* What differs between the daemons of a pod, as YAML (read back with fromYaml): the
container and port names, the ConfigMap key, backend, ports and spill directory of daemon i.
gpusPerNode 1: the single daemon as before (container kvshade, ports grpc and metrics,
kvshade.yaml, the backend value; with backend cuda:all or a list, allGpus: it serves every
GPU, numbered in PCI bus order). gpusPerNode N > 1: daemon i serves GPU i (cuda:i, every GPU
of the node visible in PCI bus order) on grpcPort + i and metricsPort + i, with its spill
tier in spill-gpu<i> of the state volume. Argument: (dict "root" $ "i" i). */}}
{{- define "kvshade.daemon" -}}
{{- $v := .root.Values -}}
{{- $i := int .i -}}
{{- if eq (include "kvshade.daemonCount" .root) "1" -}}
container: kvshade
configKey: kvshade.yaml
backend: {{ $v.backend | quote }}
grpcPortName: grpc
metricsPortName: metrics
grpcPort: {{ int $v.service.grpcPort }}
metricsPort: {{ int $v.service.metricsPort }}
spillPath: /var/lib/kvshade/spill
{{- if include "kvshade.allGpus" .root }}
allGpus: true
{{- end }}
{{- else -}}
container: kvshade-gpu{{ $i }}
configKey: kvshade-gpu{{ $i }}.yaml
backend: cuda:{{ $i }}
gpu: {{ $i | quote }}
grpcPortName: grpc-{{ $i }}
metricsPortName: metrics-{{ $i }}
grpcPort: {{ add $v.service.grpcPort $i }}
metricsPort: {{ add $v.service.metricsPort $i }}
spillPath: /var/lib/kvshade/spill-gpu{{ $i }}
{{- end -}}
{{- end -}}

{{/* gpusPerNode > 1: refuse settings that would give every daemon of the pod the same port,
path or device (they are set per daemon by the chart). */}}
{{- define "kvshade.checkPerGpu" -}}
{{- $v := .Values -}}
{{- $n := int (include "kvshade.daemonCount" .) -}}
{{- if and (gt $n 1) (include "kvshade.allGpus" .) -}}
{{- fail (printf "gpusPerNode > 1 runs one daemon per GPU, and backend %v makes one daemon serve every GPU: choose one (gpusPerNode: 1 with backend cuda:all, or gpusPerNode: N with backend auto or cuda)" $v.backend) -}}
{{- end -}}
{{- if include "kvshade.allGpus" . -}}
{{- $kv := get (get ($v.config | default dict) "kv_events" | default dict) "endpoint" | default "" -}}
{{- $kv = get ($v.env | default dict) "KVSHADE_KV_EVENTS_ENDPOINT" | default $kv | toString -}}
{{- if or (contains "*" $kv) (contains "::" $kv) (hasPrefix "ipc://" $kv) -}}
{{- fail (printf "backend %v: kv_events.endpoint %s binds, and each GPU of the daemon publishes its own KV-events; connect to the indexer instead (tcp://HOST:PORT)" $v.backend $kv) -}}
{{- end -}}
{{- $broker := get ($v.env | default dict) "KVSHADE_SAME_NODE_DESCRIPTOR_BROKER" | default "auto" | toString -}}
{{- if not (has $broker (list "auto" "off")) -}}
{{- fail (printf "backend %v: same_node.descriptor_broker %s names one socket for every GPU of the daemon; leave it auto (a socket per GPU) or off" $v.backend $broker) -}}
{{- end -}}
{{- end -}}
{{- if gt $n 1 -}}
{{- if not (has (toString $v.backend) (list "auto" "cuda")) -}}
{{- fail (printf "gpusPerNode > 1 runs daemon i on cuda:i; backend must be auto or cuda, got %v" $v.backend) -}}
{{- end -}}
{{- if ne (toString $v.gpu.visibleDevices) "all" -}}
{{- fail (printf "gpusPerNode > 1 numbers GPUs as the node does: gpu.visibleDevices must be all, got %v" $v.gpu.visibleDevices) -}}
{{- end -}}
{{- range $key := list "listen" "backend" "metrics_port" "spill_path" -}}
{{- if hasKey ($v.config | default dict) $key -}}
{{- fail (printf "gpusPerNode > 1 sets %s per daemon; remove config.%s" $key $key) -}}
{{- end -}}
{{- $var := printf "KVSHADE_%s" (upper $key) -}}
{{- if hasKey ($v.env | default dict) $var -}}
{{- fail (printf "gpusPerNode > 1 sets %s per daemon; remove env.%s" $key $var) -}}
{{- end -}}
{{- end -}}
{{- $g := int $v.service.grpcPort -}}
{{- $m := int $v.service.metricsPort -}}
{{- if and (lt $g (add $m $n)) (lt $m (add $g $n)) -}}
{{- fail (printf "gpusPerNode %d: gRPC ports %d..%d and metrics ports %d..%d overlap" $n $g (add $g $n -1) $m (add $m $n -1)) -}}
{{- end -}}
{{- $kv := get (get ($v.config | default dict) "kv_events" | default dict) "endpoint" | default "" -}}
{{- $kv = get ($v.env | default dict) "KVSHADE_KV_EVENTS_ENDPOINT" | default $kv | toString -}}
{{- if or (contains "*" $kv) (contains "::" $kv) (hasPrefix "ipc://" $kv) -}}
{{- fail (printf "gpusPerNode > 1: kv_events.endpoint %s binds, and every daemon of the pod would bind it; connect to the indexer instead (tcp://HOST:PORT)" $kv) -}}
{{- end -}}
{{- $broker := get ($v.env | default dict) "KVSHADE_SAME_NODE_DESCRIPTOR_BROKER" | default "auto" | toString -}}
{{- if not (has $broker (list "auto" "off")) -}}
{{- fail (printf "gpusPerNode > 1: same_node.descriptor_broker %s names one socket for every daemon of the pod; leave it auto (a socket per daemon) or off" $broker) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* kvshade.yaml of one daemon. Argument: (dict "root" $ "d" <kvshade.daemon of it>). */}}
{{- define "kvshade.config" -}}
{{- $v := .root.Values -}}
{{- $d := .d -}}
listen: {{ printf "0.0.0.0:%v" (int $d.grpcPort) | quote }}
backend: {{ $d.backend | quote }}
device_budget: {{ $v.tiers.device.budget | quote }}
{{- if hasKey $v.tiers.device "growth" }}
device_growth: {{ $v.tiers.device.growth | toString | quote }}
{{- end }}
host_budget: {{ $v.tiers.host.budget | quote }}
{{- if $v.tiers.spill.enabled }}
spill_path: {{ $d.spillPath }}
spill_budget: {{ $v.tiers.spill.budget | quote }}
{{- end }}
metrics_port: {{ int $d.metricsPort }}
metrics_listen: 0.0.0.0
same_node:
  export: {{ $v.sameNode.export }}
  host_memory: {{ $v.sameNode.hostMemory | default "file" }}
{{- if $v.tls.enabled }}
tls:
  cert_file: /etc/kvshade/tls/tls.crt
  key_file: /etc/kvshade/tls/tls.key
  {{- if $v.tls.requireClientCert }}
  client_ca_file: /etc/kvshade/tls/ca.crt
  require_client_cert: true
  {{- end }}
{{- end }}
{{- if $v.tenants }}
tenants:
  {{- range $v.tenants }}
  - name: {{ required "tenants[].name is required" .name | quote }}
    token_file: {{ printf "/etc/kvshade/tenants/%s" .name | quote }}
  {{- end }}
{{- end }}
{{- with $v.config }}
{{ toYaml . }}
{{- end }}
{{- end -}}
