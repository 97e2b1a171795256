"""deploy/: every kustomize overlay renders, validates offline and starts `afore serve` correctly.

Rendering needs `kubectl` (kustomize built in); LeaderWorkerSet objects are checked against the
CRD's openAPIV3Schema in ../shared/k8s (relative to the repo root), core objects and the pod
template with kubernetes-validate. Behaviour: the container's arguments, with $(VAR) expanded
the way the kubelet does, parse with afore's own CLI parser and make valid ServeOptions; the
Services reach the ports that `afore serve` listens on; /dev/shm is memory-backed; GPUs match
the shape; the A/B arms differ only in the policy and the names.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from afore.cli import build_parser  # noqa: E402
from afore.serve.launcher import ServeOptions  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
CRD = REPO.parent / "shared" / "k8s" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
K8S_VERSION = "1.32"
LWS_LEADER_LABEL = ("leaderworkerset.sigs.k8s.io/worker-index", "0")  # set by the LWS controller
AB_ARMS = ("static", "eplb", "afore")


# ---------------------------------------------------------------- rendering


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not found on PATH: deploy/ overlays cannot be rendered (install kubectl >= 1.27)")
    return path


@functools.cache
def _render(overlay: str) -> tuple:
    out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize deploy/overlays/{overlay} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_render(overlay)))


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_template(lws: dict) -> dict:
    # size 1 and no leaderTemplate: LWS builds the leader (the only pod) from workerTemplate
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    return tmpl.get("leaderTemplate") or tmpl["workerTemplate"]


def serve_container(lws: dict) -> dict:
    containers = pod_template(lws)["spec"]["containers"]
    found = [c for c in containers if c.get("command") == ["afore"] and c.get("args", [None])[0] == "serve"]
    assert len(found) == 1, f"{lws['metadata']['name']}: expected one container running `afore serve`"
    return found[0]


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, $$ escapes, others stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "ConfigMap")}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in maps, f"env {e['name']}: ConfigMap {ref['name']} is not in the rendered objects"
            assert ref["key"] in maps[ref["name"]], f"env {e['name']}: key {ref['key']} missing in {ref['name']}"
            env[e["name"]] = maps[ref["name"]][ref["key"]]
    return env


def serve_args(lws: dict, docs: list[dict]):
    """The parsed `afore serve` arguments of the pod, after the kubelet's expansion."""
    c = serve_container(lws)
    env = container_env(c, docs)
    argv = [expand(a, env) for a in c["args"]]
    unresolved = [a for a in argv if re.search(r"\$\([A-Za-z_]", a)]
    assert not unresolved, f"{lws['metadata']['name']}: undefined variables in args {unresolved}"
    return build_parser().parse_args(argv)


def serve_options(args) -> ServeOptions:
    """The ServeOptions `afore serve` builds from these arguments (its own validation runs)."""
    renamed = {"start_timeout_s": "start_timeout", "vllm_args": "vllm_arg"}
    fields = {f: getattr(args, renamed.get(f, f)) for f in ServeOptions.__struct_fields__
              if hasattr(args, renamed.get(f, f))}
    return ServeOptions(**fields)


# ---------------------------------------------------------------- schema validation


def _structural(schema):
    """The API server prunes fields a structural schema does not name; make them errors instead."""
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_structural(v) if k != "properties" else {n: _structural(s) for n, s in v.items()})
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@functools.cache
def lws_validator():
    if not CRD.exists():
        pytest.skip(f"LeaderWorkerSet CRD not found at {CRD} (the workplace's shared/k8s)")
    crd = yaml.safe_load(CRD.read_text())
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = _structural(versions["v1"]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def lws_errors(lws: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in lws_validator().iter_errors(lws)]


def core_validate(obj: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    kv.validate(obj, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- tests


def test_the_documented_profiles_exist():
    assert {"cpu-tiny", "h200-x8", "ab-static", "ab-eplb", "ab-afore", "ab"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_leaderworkersets_match_the_crd(overlay):
    docs = render(overlay)
    sets = of_kind(docs, "LeaderWorkerSet")
    assert sets, f"{overlay}: no LeaderWorkerSet rendered"
    for lws in sets:
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        assert lws_errors(lws) == [], f"{overlay}/{lws['metadata']['name']}"


def test_the_crd_check_rejects_broken_objects():
    lws = of_kind(render("cpu-tiny"), "LeaderWorkerSet")[0]
    typo = copy.deepcopy(lws)
    typo["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["shareProcesNamespace"] = True
    assert any("shareProcesNamespace" in e for e in lws_errors(typo))
    wrong = copy.deepcopy(lws)
    wrong["spec"]["leaderWorkerTemplate"]["size"] = "one"
    assert any("size" in e for e in lws_errors(wrong))
    missing = copy.deepcopy(lws)
    del missing["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert any("workerTemplate" in e for e in lws_errors(missing))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_and_pod_templates_validate(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert kinds <= {"LeaderWorkerSet", "Service", "ConfigMap"}, f"{overlay}: unexpected kinds {kinds}"
    for d in docs:
        if d["kind"] != "LeaderWorkerSet":
            core_validate(d)
    for lws in of_kind(docs, "LeaderWorkerSet"):
        tmpl = pod_template(lws)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": lws["metadata"]["name"], **tmpl.get("metadata", {})}, "spec": tmpl["spec"]}
        core_validate(pod)


def test_core_validation_rejects_broken_objects():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    svc = copy.deepcopy(of_kind(render("cpu-tiny"), "Service")[0])
    svc["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kv.ValidationError):
        core_validate(svc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_args_parse_with_afores_cli(overlay):
    docs = render(overlay)
    for lws in of_kind(docs, "LeaderWorkerSet"):
        args = serve_args(lws, docs)
        assert args.command == "serve"
        opts = serve_options(args)  # ServeOptions' own validation (ValueError on a bad field)
        assert opts.host == "0.0.0.0", "the API must listen on the pod IP, not loopback"
        assert opts.port == 8000 and opts.admin == 8001


def test_expansion_catches_undefined_variables():
    docs = render("cpu-tiny")
    lws = of_kind(docs, "LeaderWorkerSet")[0]
    serve_container(lws)["args"].append("--seed=$(AFORE_SEED)")
    with pytest.raises(AssertionError, match="AFORE_SEED"):
        serve_args(lws, docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_the_ports_afore_serve_listens_on(overlay):
    docs = render(overlay)
    sets = of_kind(docs, "LeaderWorkerSet")
    services = of_kind(docs, "Service")
    assert len(services) == 2 * len(sets), f"{overlay}: one API and one admin Service per LeaderWorkerSet"
    for svc in services:
        selector = svc["spec"]["selector"]
        assert selector.get(LWS_LEADER_LABEL[0]) == LWS_LEADER_LABEL[1], f"{svc['metadata']['name']}: select leaders"
        chosen = []
        for lws in sets:
            labels = {**pod_template(lws)["metadata"].get("labels", {}), LWS_LEADER_LABEL[0]: LWS_LEADER_LABEL[1]}
            if all(labels.get(k) == v for k, v in selector.items()):
                chosen.append(lws)
        assert len(chosen) == 1, f"{overlay}/{svc['metadata']['name']} selects {len(chosen)} LeaderWorkerSets"
        lws = chosen[0]
        args = serve_args(lws, docs)
        opts = serve_options(args)
        ports = {p["name"]: p["containerPort"] for p in serve_container(lws)["ports"]}
        for sp in svc["spec"]["ports"]:
            target = sp["targetPort"]
            number = ports[target] if isinstance(target, str) else target
            assert number in (opts.port, opts.admin), f"{svc['metadata']['name']}: port {number} is not afore's"
            if svc["metadata"]["name"].startswith("afore-api"):
                assert number == opts.port
            else:
                assert svc["metadata"]["name"].startswith("afore-admin") and number == opts.admin


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_shares_dev_shm_in_memory_and_a_pid_namespace(overlay):
    for lws in of_kind(render(overlay), "LeaderWorkerSet"):
        # afore serve runs the whole replica in one pod today (docs/deploy.md)
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1
        spec = pod_template(lws)["spec"]
        assert spec.get("shareProcessNamespace") is True
        mounts = {m["mountPath"]: m["name"] for m in serve_container(lws)["volumeMounts"]}
        assert "/dev/shm" in mounts
        volume = {v["name"]: v for v in spec["volumes"]}[mounts["/dev/shm"]]
        assert volume.get("emptyDir", {}).get("medium") == "Memory"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_match_the_shape(overlay):
    docs = render(overlay)
    for lws in of_kind(docs, "LeaderWorkerSet"):
        opts = serve_options(serve_args(lws, docs))
        res = serve_container(lws).get("resources", {})
        gpus = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
        if opts.device == "cpu":
            assert gpus == 0 and "nvidia.com/gpu" not in res.get("requests", {})
            assert opts.colocate or opts.attn_workers + opts.ffn_workers <= int(res["requests"]["cpu"])
        else:
            assert gpus >= 1 and res["requests"].get("nvidia.com/gpu") == res["limits"]["nvidia.com/gpu"]
            assert opts.colocate or opts.attn_workers + opts.ffn_workers <= gpus, \
                f"{overlay}: A + F = {opts.attn_workers + opts.ffn_workers} workers on {gpus} GPUs needs --colocate"


def test_h200_profile_is_one_worker_per_gpu():
    docs = render("h200-x8")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    opts = serve_options(serve_args(lws, docs))
    gpus = int(serve_container(lws)["resources"]["limits"]["nvidia.com/gpu"])
    assert (opts.device, opts.attn_workers, opts.ffn_workers, gpus, opts.colocate) == ("cuda", 4, 4, 8, False)
    assert opts.model.startswith("/models/")
    mounts = {m["mountPath"] for m in serve_container(lws)["volumeMounts"]}
    assert "/models" in mounts


def test_cpu_tiny_profile_is_the_built_in_model_on_cpu():
    docs = render("cpu-tiny")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    opts = serve_options(serve_args(lws, docs))
    assert (opts.model, opts.device, opts.colocate) == ("", "cpu", True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_graceful_termination(overlay):
    docs = render(overlay)
    for lws in of_kind(docs, "LeaderWorkerSet"):
        c = serve_container(lws)
        opts = serve_options(serve_args(lws, docs))
        api = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            port = api[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert (get["path"], port) == ("/health", opts.port), f"{overlay}: {probe} must ask vLLM's /health"
        # the startup probe covers afore serve's start (--start-timeout per phase, at least the vLLM phase)
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= opts.start_timeout_s
        # afore/serve/launcher.py shutdown(): vLLM 30 s, each FFN worker 10 s, the scheduler 10 s
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        needed = pre_stop + 30 + 10 * opts.ffn_workers + 10
        grace = pod_template(lws)["spec"]["terminationGracePeriodSeconds"]
        assert grace >= needed, f"{overlay}: terminationGracePeriodSeconds {grace} < {needed}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_image_is_set_by_kustomize(overlay):
    for lws in of_kind(render(overlay), "LeaderWorkerSet"):
        image = serve_container(lws)["image"]
        assert ":" in image, f"{overlay}: image {image!r} has no tag (kustomize images: did not apply)"


def _normalised_arm(arm: str) -> list[dict]:
    """The ab-<arm> render with the policy, the arm's names and the ConfigMap hash taken out."""
    docs = render(f"ab-{arm}")
    text = yaml.safe_dump_all(docs, sort_keys=True)
    text = re.sub(r"afore-serve-" + arm + r"-[a-z0-9]{10}", "afore-serve-ARM", text)
    text = re.sub(r"-" + arm + r"\b", "-ARM", text)
    text = re.sub(r"\b(afore\.dev/policy|AFORE_POLICY): " + arm + r"\b", r"\1: ARM", text)
    text = text.replace("afore-ab-" + arm, "afore-ab-ARM")
    return list(yaml.safe_load_all(text))


def test_ab_arms_differ_only_in_policy_and_names():
    base = _normalised_arm(AB_ARMS[0])
    for arm in AB_ARMS[1:]:
        assert _normalised_arm(arm) == base, f"ab-{arm} differs from ab-{AB_ARMS[0]} beyond policy and names"
    for arm in AB_ARMS:
        docs = render(f"ab-{arm}")
        (lws,) = of_kind(docs, "LeaderWorkerSet")
        assert serve_args(lws, docs).policy == arm
        assert pod_template(lws)["metadata"]["labels"]["afore.dev/policy"] == arm


def test_ab_overlay_runs_the_arms_side_by_side():
    docs = render("ab")
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))
    arms = {}
    for lws in of_kind(docs, "LeaderWorkerSet"):
        arms[serve_args(lws, docs).policy] = lws["metadata"]["name"]
    assert sorted(arms) == sorted(AB_ARMS)
    api = sorted(d["metadata"]["name"] for d in of_kind(docs, "Service") if d["metadata"]["name"].startswith("afore-api"))
    assert api == sorted(f"afore-api-{arm}" for arm in AB_ARMS)
    # the union is exactly the three arms as rendered alone
    alone = sorted((d["kind"], d["metadata"]["name"]) for arm in AB_ARMS for d in render(f"ab-{arm}"))
    assert sorted(names) == alone
