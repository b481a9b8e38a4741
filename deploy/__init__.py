"""Deploying duet on Kubernetes with KubeRay: a placement plan rendered as manifests.

``launch`` is the model (what each Ray node group runs: command, environment, resources),
``render`` builds it from a plan, ``manifests`` turns it into KubeRay and Kubernetes objects, and
``commands`` is ``duet deploy render``. The model is separate from the YAML so that a test
harness can start the very same commands outside Kubernetes (docs/guides/kubernetes.md).
"""
