{{/* Helm's naming convention: the release name alone when it already holds the chart's
name (`helm install recd ./helm/recd` names the MLflow Service `recd-mlflow`, the Kubeflow
pipeline's default), else `<release>-recd`; `fullnameOverride` wins. */}}
{{- define "recd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "recd.labels" -}}
app.kubernetes.io/name: recd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "recd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "recd.orchestratorServiceAccount" -}}
{{- default (printf "%s-orchestrator" (include "recd.fullname" .)) .Values.serviceAccount.orchestrator.name -}}
{{- end -}}

{{- define "recd.pipelineServiceAccount" -}}
{{- default (printf "%s-pipeline" (include "recd.fullname" .)) .Values.serviceAccount.pipeline.name -}}
{{- end -}}

{{- define "recd.trackingUri" -}}
http://{{ include "recd.fullname" . }}-mlflow:{{ .Values.mlflow.port }}
{{- end -}}

{{/* Pod-level security context: the restricted Pod Security profile. */}}
{{- define "recd.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level security context: no privilege escalation, no capabilities, read-only root. */}}
{{- define "recd.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}
