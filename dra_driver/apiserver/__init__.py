"""The API-server edge: the one way the driver's programs talk to Kubernetes.

- :mod:`.kube`: the official client's connection machinery (kubeconfig, service account, TLS),
  imported without its generated classes;
- :mod:`.rest`: raw JSON requests over it (``JsonApi``), and the API's errors;
- :mod:`.informer`: list-then-watch with resync and retry;
- :mod:`.bounded_json`: JSON from users (claim configs, admission reviews) decoded with a depth limit.
"""
