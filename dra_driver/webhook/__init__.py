"""The admission webhook: a program of its own (``dra-driver webhook``) that checks the opaque
configs of DeviceClasses and ResourceClaims before the API server stores them (:mod:`.server`)."""
