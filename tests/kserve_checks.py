"""A rendered KServe InferenceService checked offline against KServe's API: the kserve SDK's
models (generated from the CRDs' OpenAPI schema: each class's fields and their types, read
from the wheel `make kserve-models` fetches, its code never imported) for KServe's own
fields, and kubernetes-validate (strict) for what a predictor inlines from Kubernetes (the
pod spec: containers, volumes, security context) and for its metadata."""

from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

import kubernetes_validate

PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def kserve_models(wheel: Path) -> dict[str, dict[str, str]]:
    """{model class: {field's JSON name: its OpenAPI type}} of the SDK's generated models."""
    out: dict[str, dict[str, str]] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if not (name.startswith("kserve/models/v1") and name.endswith(".py")):
                continue
            for cls in ast.parse(z.read(name)).body:
                if not isinstance(cls, ast.ClassDef):
                    continue
                found = {
                    node.targets[0].id: ast.literal_eval(node.value)
                    for node in cls.body
                    if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) in ("openapi_types", "attribute_map")
                }
                if "openapi_types" in found:
                    types, names = found["openapi_types"], found["attribute_map"]
                    out[cls.name] = {names[k]: t for k, t in types.items()}
    return out


def _pod_spec_fields(version: str) -> set[str]:
    schema = (
        Path(kubernetes_validate.__file__).parent
        / f"kubernetes-json-schema/v{version}-local-strict/podspec-v1.json"
    )
    return set(json.loads(schema.read_text())["properties"])


def check(value, kind: str, models: dict, where: str, kubernetes: list) -> None:
    """`value` against OpenAPI type `kind`: KServe's models field by field (an unknown
    field fails), primitives by type; a Kubernetes type is kept in `kubernetes` for
    kubernetes-validate."""
    if kind in PRIMITIVES:
        ok = isinstance(value, PRIMITIVES[kind]) and not (kind == "int" and isinstance(value, bool))
        assert ok, f"{where}: {value!r} is not {kind}"
    elif kind.startswith("dict("):
        assert isinstance(value, dict), f"{where}: not an object"
        inner = kind[len("dict(") : -1].split(", ", 1)[1]
        for k, v in value.items():
            check(v, inner, models, f"{where}.{k}", kubernetes)
    elif kind.startswith("list["):
        assert isinstance(value, list), f"{where}: not a list"
        for i, v in enumerate(value):
            check(v, kind[len("list[") : -1], models, f"{where}[{i}]", kubernetes)
    elif kind in models:
        assert isinstance(value, dict), f"{where}: not an object ({kind})"
        fields = models[kind]
        for k, v in value.items():
            assert k in fields, f"{where}.{k}: not a field of KServe's {kind}"
            check(v, fields[k], models, f"{where}.{k}", kubernetes)
    else:
        kubernetes.append((where, kind, value))


def assert_valid_inference_service(obj: dict, models: dict, version: str) -> None:
    assert obj["apiVersion"] == "serving.kserve.io/v1beta1" and obj["kind"] == "InferenceService"
    kubernetes: list = []
    check(obj, "V1beta1InferenceService", models, "InferenceService", kubernetes)
    # the predictor's pod-spec fields, as the Pod KServe makes of them
    predictor = obj["spec"]["predictor"]
    pod_fields = _pod_spec_fields(version)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**obj["metadata"], "labels": predictor.get("labels", {})},
        "spec": {k: v for k, v in predictor.items() if k in pod_fields},
    }
    kubernetes_validate.validate(pod, version, strict=True)
    covered = {f"InferenceService.spec.predictor.{k}" for k in pod_fields}
    covered.add("InferenceService.metadata")
    left = [
        (where, kind)
        for where, kind, _ in kubernetes
        if not any(
            where == c or where.startswith(c + ".") or where.startswith(c + "[") for c in covered
        )
    ]
    assert not left, f"Kubernetes types outside the pod spec, unchecked: {left}"
