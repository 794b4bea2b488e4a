"""Shared by the chart and DAG tests: what every pod spec we produce must satisfy (the
restricted Pod Security profile, plus pinned images and resources)."""


def assert_restricted(name: str, spec: dict, api_client: bool = False) -> None:
    """`api_client`: the pod talks to the Kubernetes API (a TrainJob's submitter), so its
    service account token is mounted; every other pod goes without."""
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, name
    assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
    assert spec.get("automountServiceAccountToken") is api_client, name
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    writable = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    assert "/tmp" in writable, name
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
        assert not sc.get("privileged")
        assert ":" in c["image"] and not c["image"].endswith(":latest"), (name, c["image"])
        assert "limits" in c["resources"] and "requests" in c["resources"], (name, c["name"])
    for v in spec.get("volumes", []):
        assert "hostPath" not in v, name
