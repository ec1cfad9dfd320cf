{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "nestquant.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name: <release>-nestquant, or the release name when it has "nestquant". */}}
{{- define "nestquant.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nestquant.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "nestquant.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component (router or engine): pass (dict "root" $ "component" "router"). */}}
{{- define "nestquant.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nestquant.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image of one service: (dict "root" $ "service" "worker"). */}}
{{- define "nestquant.image" -}}
{{- $img := .root.Values.image -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- if $img.registry -}}
{{- printf "%s/%s/%s:%s" $img.registry $img.repository .service $tag -}}
{{- else -}}
{{- printf "%s/%s:%s" $img.repository .service $tag -}}
{{- end -}}
{{- end -}}

{{- define "nestquant.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "nestquant.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* A read-only volume from a PVC or a hostPath: (dict "name" "model" "spec" .Values.model). */}}
{{- define "nestquant.dataVolume" -}}
- name: {{ .name }}
{{- if .spec.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .spec.existingClaim }}
    readOnly: true
{{- else if .spec.hostPath }}
  hostPath:
    path: {{ .spec.hostPath }}
    type: Directory
{{- else }}
{{- fail (printf "values: set %s.existingClaim or %s.hostPath" .name .name) }}
{{- end }}
{{- end -}}

{{/* The mount of such a volume: (dict "name" "model" "spec" .Values.model "path" "/models/model"). */}}
{{- define "nestquant.dataVolumeMount" -}}
- name: {{ .name }}
  mountPath: {{ .path }}
  readOnly: true
{{- with .spec.subPath }}
  subPath: {{ . }}
{{- end }}
{{- end -}}

{{/* Ports of worker rank r inside the engine pod (containers share its network namespace). */}}
{{/* Ranks each engine pod holds. */}}
{{- define "nestquant.ranksPerNode" -}}{{ div (int .Values.tensorParallelSize) (int .Values.engine.nodes) }}{{- end -}}
{{/* The engine pods' headless Service (engine.nodes > 1): their stable DNS names. */}}
{{- define "nestquant.enginePeers" -}}{{ include "nestquant.fullname" . }}-engine-peers{{- end -}}
{{/* Engine pod 0 (rank 0, the deciding streamer) by its stable name (engine.nodes > 1). */}}
{{- define "nestquant.engineLeaderHost" -}}
{{ include "nestquant.fullname" . }}-engine-0.{{ include "nestquant.enginePeers" . }}.{{ .Release.Namespace }}.svc
{{- end -}}
{{/* The pod's index in the engine StatefulSet (its node's place in the group), as NQ_NODE_RANK. */}}
{{- define "nestquant.nodeRankEnv" -}}
- name: NQ_NODE_RANK
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
{{- end -}}
{{- define "nestquant.workerGrpcPort" -}}{{ add 8100 (mul 2 .) }}{{- end -}}
{{- define "nestquant.workerMetricsPort" -}}{{ add 8101 (mul 2 .) }}{{- end -}}

{{/* Checks that fail the render with a message naming the value. */}}
{{- define "nestquant.validate" -}}
{{- if lt (int .Values.tensorParallelSize) 1 -}}
{{- fail "values: tensorParallelSize must be at least 1" -}}
{{- end -}}
{{- $nodes := int .Values.engine.nodes -}}
{{- if ne (mod (int .Values.tensorParallelSize) $nodes) 0 -}}
{{- fail (printf "values: tensorParallelSize %d is not a multiple of engine.nodes %d (each node holds the same number of ranks)" (int .Values.tensorParallelSize) $nodes) -}}
{{- end -}}
{{- if gt (div (int .Values.tensorParallelSize) $nodes) 16 -}}
{{- fail "values: more than 16 ranks a node (tensorParallelSize / engine.nodes) does not fit one node's pod" -}}
{{- end -}}
{{- if and (gt $nodes 1) (ne .Values.worker.backend "cuda") -}}
{{- fail "values: engine.nodes above 1 needs worker.backend cuda (the cpu backend's ranks share one host's memory)" -}}
{{- end -}}
{{- if not (has .Values.worker.backend (list "cuda" "cpu")) -}}
{{- fail "values: worker.backend must be cuda or cpu" -}}
{{- end -}}
{{- end -}}

{{/*
Internal gRPC between the router and the workers (values internalTls): the mutual-TLS flags
when a secret is given, else the explicit plain-text switch.
*/}}
{{- define "nestquant.internalTlsArgs" -}}
{{- if .Values.internalTls.secretName }}
- --tls_ca=/etc/nestquant/tls/ca.crt
- --tls_cert=/etc/nestquant/tls/tls.crt
- --tls_key=/etc/nestquant/tls/tls.key
{{- else }}
- --allow_plaintext_internal
{{- end }}
{{- end }}

{{- define "nestquant.internalTlsMount" -}}
{{- if .Values.internalTls.secretName }}
- name: internal-tls
  mountPath: /etc/nestquant/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "nestquant.internalTlsVolume" -}}
{{- if .Values.internalTls.secretName }}
- name: internal-tls
  secret:
    secretName: {{ .Values.internalTls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}
