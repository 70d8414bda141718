{{/* Names and labels shared by the templates. */}}

{{- define "dra-driver-gpu.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dra-driver-gpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "dra-driver-gpu.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The namespace of the plugin's objects: namespaceOverride, else the release's. "default" is refused
unless allowDefaultNamespace: a node-level daemon with node-wide permissions does not belong among
the workloads of the default namespace.
*/}}
{{- define "dra-driver-gpu.namespace" -}}
{{- $namespace := .Values.namespaceOverride | default .Release.Namespace -}}
{{- if and (eq $namespace "default") (not .Values.allowDefaultNamespace) -}}
{{- fail "refusing to install into the namespace default: use --namespace dra-driver-gpu --create-namespace (or namespaceOverride), or set allowDefaultNamespace=true" -}}
{{- end -}}
{{- $namespace -}}
{{- end -}}

{{- define "dra-driver-gpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dra-driver-gpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dra-driver-gpu.labels" -}}
{{ include "dra-driver-gpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
The account the plugin pods run as. The ClusterRoleBinding and the admission policy name this same
account, so that the policy constrains exactly the identity that holds the permissions.
*/}}
{{- define "dra-driver-gpu.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "dra-driver-gpu.fullname" .) -}}
{{- end -}}

{{- define "dra-driver-gpu.gpuClassName" -}}
{{- .Values.deviceClasses.gpu.name | default .Values.driverName -}}
{{- end -}}

{{/*
gpu.nvidia.com -> mig.nvidia.com, the name NVIDIA's driver gives its MIG class; a driver name that
does not start with "gpu." gets "mig." in front.
*/}}
{{- define "dra-driver-gpu.migClassName" -}}
{{- .Values.deviceClasses.mig.name | default (printf "mig.%s" (trimPrefix "gpu." .Values.driverName)) -}}
{{- end -}}

{{- define "dra-driver-gpu.httpPort" -}}
{{- regexFind "[0-9]+$" .Values.httpAddress -}}
{{- end -}}

{{/*
gpu.nvidia.com -> maintenance.nvidia.com: the class of the GPUs' maintenance devices, which only
admin-access requests may use (templates/maintenance.yaml).
*/}}
{{- define "dra-driver-gpu.maintenanceClassName" -}}
{{- .Values.deviceClasses.maintenance.name | default (printf "maintenance.%s" (trimPrefix "gpu." .Values.driverName)) -}}
{{- end -}}
