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

{{/* The serving container (`recd serve`), for the Deployment and the InferenceService: its
name and its port's name are given (KServe's container is kserve-container, and Knative
takes a port named http1 or h2c, probes by number). */}}
{{- define "recd.serveContainer" -}}
- name: {{ .name }}
  image: {{ include "recd.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["recd"]
  args:
    - --tracking-uri={{ include "recd.trackingUri" .root }}
    - serve
    - --model={{ .root.Values.serving.model }}
    - --config=/etc/recd/pipeline.yaml
    - --host=0.0.0.0
    - --port={{ .root.Values.serving.port }}
    - --follow-alias-s={{ .root.Values.serving.followAliasSeconds }}
  env:
    - {name: HOME, value: /home/recd}
    - {name: MPLCONFIGDIR, value: /tmp/matplotlib}
  ports:
    - name: {{ .portName }}
      containerPort: {{ .root.Values.serving.port }}
      protocol: TCP
  startupProbe:
    httpGet: {path: /ping, port: {{ .probePort }}}
    periodSeconds: 5
    failureThreshold: 120
  readinessProbe:
    httpGet: {path: /ready, port: {{ .probePort }}}
    periodSeconds: 10
    timeoutSeconds: 5
  livenessProbe:
    httpGet: {path: /ping, port: {{ .probePort }}}
    periodSeconds: 20
    failureThreshold: 3
  resources:
    {{- toYaml .root.Values.serving.resources | nindent 4 }}
  securityContext:
    {{- include "recd.containerSecurityContext" .root | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: home, mountPath: /home/recd}
    - {name: config, mountPath: /etc/recd, readOnly: true}
{{- end }}

{{/* The serving pods' volumes: /tmp, a home, the pipeline config. */}}
{{- define "recd.serveVolumes" -}}
- name: tmp
  emptyDir: {sizeLimit: {{ .Values.tmpVolumeSizeLimit }}}
- name: home
  emptyDir: {sizeLimit: 256Mi}
- name: config
  configMap:
    name: {{ include "recd.fullname" . }}-pipeline
    items: [{key: pipeline.yaml, path: pipeline.yaml}]
{{- end }}
