#!/usr/bin/env python3
"""Every Kubernetes object troupe renders validates against the Kubernetes
schemas, and deploy/k8s is what the renderer makes today.

    k8s_objects_test.py --troupe build/bin/troupe --source .

1. `troupe deploy render --target k8s` of every deploy/examples/*.yaml: every
   object validates (strict: unknown fields are errors) against the schemas of
   Kubernetes K8S_VERSION that the kubernetes-validate wheel ships (offline).
2. deploy/k8s (base + overlays) equals a fresh deploy/k8s/generate.py run.
3. `kubectl kustomize` of every overlay validates too (skipped, with a
   message, when kubectl is not installed).
"""
import argparse
import filecmp
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import yaml
import kubernetes_validate.utils as kv

K8S_VERSION = "1.32.0"  # the pinned Kubernetes version (kubernetes-validate 1.37.0 ships 1.25..1.37)

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL", msg)


def validate_docs(docs, where):
    """Validates each object; a kind without a schema is a failure, not a skip."""
    n = 0
    for doc in docs:
        if not doc:
            continue
        name = f"{where}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
            n += 1
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            fail(f"{name}: {path}: {e.message}")
        except kv.SchemaNotFoundError as e:
            fail(f"{name}: {e.message}")
    return n


def check_validator_rejects():
    """The validator is not vacuous: an unknown field and a wrong type fail."""
    bad = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"clusterIp": "None"}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"},
         "spec": {"replicas": "two", "serviceName": "x", "selector": {}, "template": {}}},
    ]
    for doc in bad:
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
            fail(f"the validator accepted a broken {doc['kind']}")
        except kv.ValidationError:
            pass


def check_dockerfile(source, tmp):
    """deploy/Dockerfile builds the image the objects name, runs as the user
    the pods require, and installs Debian packages that exist."""
    text = open(os.path.join(source, "deploy/Dockerfile")).read()
    images = set()
    for f in glob.glob(os.path.join(tmp, "*.yaml", "*.yaml")):
        for d in yaml.safe_load_all(open(f)):
            if d and d["kind"] in ("StatefulSet", "Deployment"):
                images.add(d["spec"]["template"]["spec"]["containers"][0]["image"])
                if d["spec"]["template"]["spec"]["securityContext"]["runAsUser"] != 10001:
                    fail(f"{f}: runAsUser is not the Dockerfile's USER 10001")
    for image in images:
        if f"-t {image} " not in text:
            fail(f"deploy/Dockerfile does not say how to build {image}")
    if "USER 10001:10001" not in text:
        fail("deploy/Dockerfile does not run as USER 10001:10001")
    runtime = text[text.rindex("FROM "):]
    start = runtime.index("--no-install-recommends") + len("--no-install-recommends")
    packages = runtime[start:runtime.index("&&", start)].replace("\\", " ").split()
    apt = shutil.which("apt-cache")
    if not apt or subprocess.run([apt, "show", "libc6"], capture_output=True).returncode != 0:
        print("SKIP Dockerfile packages: no apt package lists here")
        return
    missing = [p for p in packages if subprocess.run([apt, "show", p], capture_output=True).returncode != 0]
    if missing:
        fail(f"deploy/Dockerfile installs packages apt does not know: {missing}")
    print(f"ok deploy/Dockerfile: image {', '.join(sorted(images))}, user 10001, {len(packages)} runtime packages known to apt")


def check_examples(troupe, source, tmp):
    total = 0
    examples = sorted(glob.glob(os.path.join(source, "deploy/examples/*.yaml")))
    if len(examples) < 4:
        fail(f"expected at least 4 example manifests, found {len(examples)}")
    for manifest in examples:
        out = os.path.join(tmp, os.path.basename(manifest))
        r = subprocess.run([troupe, "deploy", "render", "--manifest", manifest, "--target", "k8s", "--out", out],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"render {manifest}: exit {r.returncode}: {r.stderr}")
            continue
        docs = []
        for f in sorted(glob.glob(os.path.join(out, "*.yaml"))):
            if os.path.basename(f) == "kustomization.yaml":
                continue
            with open(f) as fh:
                docs.extend(yaml.safe_load_all(fh))
        n = validate_docs(docs, os.path.relpath(manifest, source))
        kinds = sorted({d["kind"] for d in docs})
        # The stream form (stdout) holds the same objects.
        stream = subprocess.run([troupe, "deploy", "render", "--manifest", manifest, "--target", "k8s"],
                                capture_output=True, text=True, check=True).stdout
        if len([d for d in yaml.safe_load_all(stream) if d]) != len(docs):
            fail(f"{manifest}: stdout and --out render different numbers of objects")
        print(f"ok {os.path.relpath(manifest, source)}: {n}/{len(docs)} objects valid against Kubernetes "
              f"{K8S_VERSION} ({', '.join(kinds)})")
        total += n
    return total


def check_kustomize_tree(troupe, source, tmp):
    sys.path.insert(0, os.path.join(source, "deploy", "k8s"))
    sys.dont_write_bytecode = True  # leave the source tree as it is
    import generate  # noqa: E402

    fresh = os.path.join(tmp, "k8s")
    os.makedirs(fresh)
    generate.generate(troupe, source, fresh)
    committed = os.path.join(source, "deploy", "k8s")
    for sub in ("base", "overlays/colocated", "overlays/disaggregated"):
        a, b = os.path.join(committed, sub), os.path.join(fresh, sub)
        names_a = sorted(f for f in os.listdir(a)) if os.path.isdir(a) else []
        names_b = sorted(os.listdir(b))
        if names_a != names_b:
            fail(f"deploy/k8s/{sub}: files {names_a} but the renderer makes {names_b}; run deploy/k8s/generate.py")
            continue
        for f in names_a:
            if not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False):
                fail(f"deploy/k8s/{sub}/{f} differs from the renderer's output; run deploy/k8s/generate.py")
    print("ok deploy/k8s matches deploy/k8s/generate.py")


def check_kubectl_kustomize(source):
    kubectl = shutil.which("kubectl")
    if not kubectl:
        print("SKIP kubectl kustomize: kubectl is not installed")
        return 0
    total = 0
    for overlay in sorted(glob.glob(os.path.join(source, "deploy/k8s/overlays/*"))):
        r = subprocess.run([kubectl, "kustomize", overlay], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"kubectl kustomize {overlay}: {r.stderr}")
            continue
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        n = validate_docs(docs, f"kustomize {os.path.relpath(overlay, source)}")
        if any(d["metadata"].get("namespace") != "troupe" for d in docs):
            fail(f"kubectl kustomize {overlay}: not every object is in namespace troupe")
        print(f"ok kubectl kustomize {os.path.relpath(overlay, source)}: {n}/{len(docs)} objects valid")
        total += n
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--troupe", required=True)
    p.add_argument("--source", required=True)
    a = p.parse_args()
    check_validator_rejects()
    with tempfile.TemporaryDirectory() as tmp:
        rendered = check_examples(a.troupe, a.source, tmp)
        check_dockerfile(a.source, tmp)
        check_kustomize_tree(a.troupe, a.source, tmp)
        kustomized = check_kubectl_kustomize(a.source)
    print(f"{rendered} rendered objects and {kustomized} kustomized objects validated against Kubernetes {K8S_VERSION}")
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
