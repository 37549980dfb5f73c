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

{{/* The probe command: grpc.health.v1 through the kvshade CLI, with TLS when it is on. */}}
{{- define "kvshade.probeExec" -}}
exec:
  command:
    - kvshade
    - --target
    - {{ printf "127.0.0.1:%v" .Values.service.grpcPort | quote }}
    - --tls
    - --ca
    - /etc/kvshade/tls/ca.crt
    {{- with .Values.tls.serverName }}
    - --server-name
    - {{ . | quote }}
    {{- end }}
    {{- if .Values.tls.requireClientCert }}
    - --cert
    - /etc/kvshade/tls/tls.crt
    - --key
    - /etc/kvshade/tls/tls.key
    {{- end }}
    - status
    - --wait
    - "2"
{{- end -}}
