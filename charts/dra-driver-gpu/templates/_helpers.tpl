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

{{/*
The driver's image: repository@digest when image.digest is set (the image exactly as built and
reviewed, whatever the tag points at later), else repository:tag.
*/}}
{{- define "dra-driver-gpu.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "dra-driver-gpu.httpPort" -}}
{{- regexFind "[0-9]+$" .Values.httpAddress -}}
{{- end -}}

{{/*
gpu.nvidia.com -> maintenance.nvidia.com: the class of the GPUs' maintenance devices, which only
admin-access requests may use (templates/maintenance.yaml).
*/}}
{{- define "dra-driver-gpu.vfioClassName" -}}
{{- printf "vfio.%s" .Values.driverName -}}
{{- end -}}

{{- define "dra-driver-gpu.maintenanceClassName" -}}
{{- .Values.deviceClasses.maintenance.name | default (printf "maintenance.%s" (trimPrefix "gpu." .Values.driverName)) -}}
{{- end -}}

{{/*
The optional features, after featureGates (docs/configuration.md, "Feature gates"), as YAML for
fromYaml: computeDomains, maintenanceDevices, nodeLabels, deviceMetadata, passthrough, mps,
imexDaemonsWithDNSNames and hostManagedImex (booleans) and migPartitions. A gate that is set wins
over the value it is named after (NodeLabels -> nodeLabels, PassthroughSupport -> passthrough;
NVIDIA's DeviceMetadata -> deviceMetadata, which here needs no PassthroughSupport;
HostManagedIMEXDaemon -> hostManagedImex); NVIDIA's DynamicMIG
maps to migPartitions (false: none; true: the list of GPUs, or else all). NVIDIA's gates for
what this driver always does, or never does, are accepted where they agree and refused with the
reason where they do not, so a values file written for NVIDIA's chart never silently means less.
*/}}
{{- define "dra-driver-gpu.features" -}}
{{- $gates := .Values.featureGates | default dict -}}
{{- $features := dict "computeDomains" .Values.computeDomains "maintenanceDevices" .Values.maintenanceDevices "nodeLabels" .Values.nodeLabels "deviceMetadata" .Values.deviceMetadata "migPartitions" .Values.migPartitions "passthrough" .Values.passthrough -}}
{{- range $gate, $value := dict "ComputeDomains" "computeDomains" "MaintenanceDevices" "maintenanceDevices" "NodeLabels" "nodeLabels" "DeviceMetadata" "deviceMetadata" "PassthroughSupport" "passthrough" -}}
{{- if hasKey $gates $gate -}}
{{- $_ := set $features $value (index $gates $gate) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $features "imexDaemonsWithDNSNames" .Values.computeDomainController.imexDaemonsWithDNSNames -}}
{{- if hasKey $gates "IMEXDaemonsWithDNSNames" -}}
{{- $_ := set $features "imexDaemonsWithDNSNames" $gates.IMEXDaemonsWithDNSNames -}}
{{- end -}}
{{- $_ := set $features "hostManagedImex" .Values.hostManagedImex -}}
{{- if hasKey $gates "HostManagedIMEXDaemon" -}}
{{- $_ := set $features "hostManagedImex" $gates.HostManagedIMEXDaemon -}}
{{- end -}}
{{- if hasKey $gates "DynamicMIG" -}}
{{- if not $gates.DynamicMIG -}}
{{- $_ := set $features "migPartitions" "none" -}}
{{- else if has .Values.migPartitions (list "none" "auto" "mig-mode") -}}
{{- $_ := set $features "migPartitions" "all" -}}
{{- end -}}
{{- end -}}
{{- /* MPS claims need the plugin to create Deployments (its MPS control daemons): NVIDIA grants
that only with its MPSSupport gate; here MPS is on unless the gate is false, which grants no
Deployments at all and leaves MPS claims refused on a real node. */ -}}
{{- $_ := set $features "mps" (ne (toString (index $gates "MPSSupport")) "false") -}}
{{- range $gate, $what := dict "TimeSlicingSettings" "time-slicing configs" "NVMLDeviceHealthCheck" "GPU health checks (Xid events, lost GPUs)" "ComputeDomainCliques" "ComputeDomainClique objects" -}}
{{- if and (hasKey $gates $gate) (not (index $gates $gate)) -}}
{{- fail (printf "featureGates.%s=false: this driver always serves %s and cannot switch them off; leave the gate out" $gate $what) -}}
{{- end -}}
{{- end -}}
{{- toYaml $features -}}
{{- end -}}
