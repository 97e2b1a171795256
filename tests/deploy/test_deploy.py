"""deploy/: every kustomize overlay renders, validates offline and starts `afore serve` correctly.

Rendering needs `kubectl` (kustomize built in); LeaderWorkerSet objects are checked against the
CRD's openAPIV3Schema in ../shared/k8s (relative to the repo root), core objects and the pod
template with kubernetes-validate. Behaviour: the container's arguments, with $(VAR) expanded
the way the kubelet does (the LeaderWorkerSet controller's LWS_* variables included), parse with
afore's own CLI parser and make valid ServeOptions; each Service reaches the pods of the role that
serves it, on a port `afore serve` listens on; /dev/shm is memory-backed; GPUs match the workers
of each pod; the two-node replica pairs an FFN leader with an attention worker that agree on the
shape, the ports and the shared token; the A/B arms differ only in the policy and the names.
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from afore import shared  # noqa: E402
from afore.serve.cli import add_arguments  # noqa: E402
from afore.serve.launcher import ServeOptions, check_shape  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
CRD_PARTS = ("k8s", "leaderworkerset.x-k8s.io_leaderworkersets.yaml")  # in the workplace's shared folder (afore.shared)
K8S_VERSION = "1.32"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"  # pod label set by the LWS controller: 0 = leader
NAMESPACE = "NAMESPACE"  # stands for the namespace the objects are applied to
AB_ARMS = ("static", "eplb", "afore")
# which pods a Service must reach, by `afore serve --role`: the OpenAI API is vLLM's (roles all and
# attention); the admin endpoint that switches the policy is the scheduler's node's (all and ffn)
SERVICE_ROLES = {"afore-api": ("all", "attention"), "afore-admin": ("all", "ffn")}


# ---------------------------------------------------------------- rendering


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        # the development and CI machines have it (../shared/k8s/README.md): its absence is a broken
        # environment, not a reason to pass without checking the manifests
        pytest.fail("kubectl not found on PATH: deploy/ overlays cannot be rendered (install kubectl >= 1.27)")
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


def pod_templates(lws: dict) -> list[tuple[int, dict]]:
    """The pods of one LWS group as (worker index, pod template): the leader (index 0) from
    leaderTemplate, or from workerTemplate when there is none (size 1: the only pod); the
    workers 1 .. size-1 from workerTemplate."""
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    leader = tmpl.get("leaderTemplate") or tmpl["workerTemplate"]
    return [(0, leader)] + [(i, tmpl["workerTemplate"]) for i in range(1, tmpl.get("size", 1))]


def pod_template(lws: dict, index: int = 0) -> dict:
    return dict(pod_templates(lws))[index]


def pod_labels(lws: dict, index: int) -> dict[str, str]:
    """The labels of the group's pod `index`: its template's, plus the worker index LWS adds."""
    return {**pod_template(lws, index).get("metadata", {}).get("labels", {}), WORKER_INDEX: str(index)}


def leader_address(lws: dict) -> str:
    """LWS_LEADER_ADDRESS of group 0: <name>-<group>.<name>.<namespace>, the leader pod's DNS
    name under the headless Service the LWS controller creates (subdomainPolicy Shared)."""
    name = lws["metadata"]["name"]
    return f"{name}-0.{name}.{NAMESPACE}"


def lws_env(lws: dict, index: int) -> dict[str, str]:
    """The variables the LWS controller's pod webhook prepends to every container's env."""
    return {"LWS_LEADER_ADDRESS": leader_address(lws),
            "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"].get("size", 1)),
            "LWS_WORKER_INDEX": str(index)}


def serve_container(lws: dict, index: int = 0) -> dict:
    containers = pod_template(lws, index)["spec"]["containers"]
    found = [c for c in containers if c.get("command") == ["afore"] and c.get("args", [None])[0] == "serve"]
    assert len(found) == 1, f"{lws['metadata']['name']}/{index}: expected one container running `afore serve`"
    return found[0]


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, $$ escapes, others stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def secret_placeholder(ref: dict) -> str:
    return f"<secret {ref['name']}/{ref['key']}>"


def container_env(container: dict, docs: list[dict], lws: dict, index: int) -> dict[str, str]:
    """The container's environment as the kubelet sees it: LWS's variables first (the webhook
    prepends them), then the container's own entries in order. A Secret is the user's (not
    rendered): its value stands as a placeholder naming the Secret and the key."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "ConfigMap")}
    env = lws_env(lws, index)
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in maps, f"env {e['name']}: ConfigMap {ref['name']} is not in the rendered objects"
            assert ref["key"] in maps[ref["name"]], f"env {e['name']}: key {ref['key']} missing in {ref['name']}"
            env[e["name"]] = maps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = secret_placeholder(e["valueFrom"]["secretKeyRef"])
        else:
            raise AssertionError(f"env {e['name']}: unexpected source {e}")
    return env


def serve_parser() -> argparse.ArgumentParser:
    """`afore serve`'s own argument parser (afore.serve.cli.add_arguments)."""
    parser = argparse.ArgumentParser(prog="afore serve")
    add_arguments(parser)
    return parser


def serve_args(lws: dict, docs: list[dict], index: int = 0) -> argparse.Namespace:
    """The parsed `afore serve` arguments of the group's pod `index`, after the kubelet's expansion."""
    c = serve_container(lws, index)
    env = container_env(c, docs, lws, index)
    argv = [expand(a, env) for a in c["args"]]
    unresolved = [a for a in argv if re.search(r"\$\([A-Za-z_]", a)]
    assert not unresolved, f"{lws['metadata']['name']}/{index}: undefined variables in args {unresolved}"
    assert argv[0] == "serve", f"{lws['metadata']['name']}/{index}: expected `afore serve`, got {argv[0]!r}"
    return serve_parser().parse_args(argv[1:])


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The ServeOptions `afore serve` builds from these arguments (its own construction, defaults
    and validation)."""
    from afore.serve.cli import options_from_args

    return options_from_args(args)


def pod_options(lws: dict, docs: list[dict], index: int = 0) -> ServeOptions:
    return serve_options(serve_args(lws, docs, index))


def pods(docs: list[dict]):
    """(LeaderWorkerSet, worker index) of every pod of every group's first replica."""
    return [(lws, index) for lws in of_kind(docs, "LeaderWorkerSet") for index, _ in pod_templates(lws)]


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
    crd_path = shared.find(*CRD_PARTS)
    if crd_path is None:
        pytest.fail(f"LeaderWorkerSet CRD not found in {[str(p) for p in shared.candidates(*CRD_PARTS)]}: the deploy "
                    "tests need the workplace's shared/k8s (as CI has it)")
    crd = yaml.safe_load(crd_path.read_text())
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
    assert {"cpu-tiny", "h200-x8", "h200-2node", "ab-static", "ab-eplb", "ab-afore", "ab"} <= set(OVERLAYS)


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
    # the leaderTemplate is checked too
    split = of_kind(render("h200-2node"), "LeaderWorkerSet")[0]
    split["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["port"] = 8001
    assert any("leaderTemplate" in e and "port" in e for e in lws_errors(split))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_and_pod_templates_validate(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert kinds <= {"LeaderWorkerSet", "Service", "ConfigMap", "NetworkPolicy"}, f"{overlay}: unexpected kinds {kinds}"
    for d in docs:
        if d["kind"] != "LeaderWorkerSet":
            core_validate(d)
    for lws, index in pods(docs):
        tmpl = pod_template(lws, index)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{lws['metadata']['name']}-0-{index}", **tmpl.get("metadata", {})},
               "spec": tmpl["spec"]}
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
    for lws, index in pods(docs):
        opts = pod_options(lws, docs, index)  # ServeOptions' own validation (ValueError on a bad field)
        assert opts.host == "0.0.0.0", "the API, the admin endpoint and the FFN node's ports must listen on the pod IP"
        assert opts.admin == 8001
        if opts.role != "ffn":  # the FFN node serves no API
            assert opts.port == 8000


def test_expansion_catches_undefined_variables():
    docs = render("cpu-tiny")
    lws = of_kind(docs, "LeaderWorkerSet")[0]
    serve_container(lws)["args"].append("--seed=$(AFORE_SEED)")
    with pytest.raises(AssertionError, match="AFORE_SEED"):
        serve_args(lws, docs)


def test_expansion_knows_the_lws_variables_and_only_those():
    docs = render("h200-2node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    assert serve_args(lws, docs, 1).ffn_host == leader_address(lws)
    args = serve_container(lws, 1)["args"]
    args[args.index("--ffn-host=$(LWS_LEADER_ADDRESS)")] = "--ffn-host=$(LWS_LEADER_ADRESS)"  # misspelt
    with pytest.raises(AssertionError, match="LWS_LEADER_ADRESS"):
        serve_args(lws, docs, 1)
    # the worker index is the pod's own, the group size the LeaderWorkerSet's
    env = container_env(serve_container(lws, 1), docs, lws, 1)
    assert (env["LWS_WORKER_INDEX"], env["LWS_GROUP_SIZE"]) == ("1", "2")
    assert container_env(serve_container(lws, 0), docs, lws, 0)["LWS_WORKER_INDEX"] == "0"


def service_errors(svc: dict, docs: list[dict]) -> list[str]:
    """What is wrong with a Service: it must select the pods of exactly one LeaderWorkerSet, all
    of a role that serves it (SERVICE_ROLES), and target a port their container exposes and
    `afore serve` listens on (the API port, or the admin port)."""
    name = svc["metadata"]["name"]
    kind = next((k for k in SERVICE_ROLES if name == k or name.startswith(k + "-")), None)
    if kind is None:
        return [f"{name}: not an API or admin Service"]
    selector = svc["spec"]["selector"]
    chosen = [(lws, index) for lws, index in pods(docs)
              if all(pod_labels(lws, index).get(k) == v for k, v in selector.items())]
    errors = []
    if len({lws["metadata"]["name"] for lws, _ in chosen}) != 1:
        return [f"{name} selects pods of {len({lws['metadata']['name'] for lws, _ in chosen})} LeaderWorkerSets"]
    for lws, index in chosen:
        opts = pod_options(lws, docs, index)
        where = f"{name} -> {lws['metadata']['name']} pod {index} (role {opts.role})"
        if opts.role not in SERVICE_ROLES[kind]:
            errors.append(f"{where}: {kind} must reach role {' or '.join(SERVICE_ROLES[kind])}")
        ports = {p["name"]: p["containerPort"] for p in serve_container(lws, index)["ports"]}
        for sp in svc["spec"]["ports"]:
            target = sp["targetPort"]
            if isinstance(target, str) and target not in ports:
                errors.append(f"{where}: target port {target!r} is not a container port")
                continue
            number = ports[target] if isinstance(target, str) else target
            wanted = opts.port if kind == "afore-api" else opts.admin
            if number != wanted or number not in ports.values():
                errors.append(f"{where}: targets port {number}, afore serve listens on {wanted}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_the_ports_afore_serve_listens_on(overlay):
    docs = render(overlay)
    sets = of_kind(docs, "LeaderWorkerSet")
    services = of_kind(docs, "Service")
    assert len(services) == 2 * len(sets), f"{overlay}: one API and one admin Service per LeaderWorkerSet"
    for svc in services:
        assert service_errors(svc, docs) == []


def test_service_check_rejects_the_wrong_pod():
    docs = render("h200-2node")
    api = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}["afore-api"]
    api["spec"]["selector"][WORKER_INDEX] = "0"  # the FFN node: no API there
    assert any("role ffn" in e for e in service_errors(api, docs))
    admin = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}["afore-admin"]
    admin["spec"]["selector"][WORKER_INDEX] = "1"  # the attention node cannot switch the policy
    assert any("role attention" in e for e in service_errors(admin, docs))
    del admin["spec"]["selector"][WORKER_INDEX]  # both pods
    assert service_errors(admin, docs)
    admin["spec"]["selector"][WORKER_INDEX] = "0"
    admin["spec"]["ports"][0]["targetPort"] = "store"
    assert any("29600" in e for e in service_errors(admin, docs))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_shares_dev_shm_in_memory_and_a_pid_namespace(overlay):
    docs = render(overlay)
    for lws in of_kind(docs, "LeaderWorkerSet"):
        roles = [pod_options(lws, docs, index).role for index, _ in pod_templates(lws)]
        # role all: the whole replica in one pod; split: the FFN leader and one attention worker
        assert roles in (["all"], ["ffn", "attention"]), f"{overlay}: group roles {roles}"
    for lws, index in pods(docs):
        spec = pod_template(lws, index)["spec"]
        assert spec.get("shareProcessNamespace") is True
        mounts = {m["mountPath"]: m["name"] for m in serve_container(lws, index)["volumeMounts"]}
        assert "/dev/shm" in mounts
        volume = {v["name"]: v for v in spec["volumes"]}[mounts["/dev/shm"]]
        assert volume.get("emptyDir", {}).get("medium") == "Memory"


class _Experts:
    """Enough of a ModelSpec for check_shape: as many experts as FFN workers (the model's own
    count is checked by `afore serve` at start)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_match_the_shape(overlay):
    docs = render(overlay)
    for lws, index in pods(docs):
        opts = pod_options(lws, docs, index)
        res = serve_container(lws, index).get("resources", {})
        gpus = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
        if opts.device == "cpu":
            assert gpus == 0 and "nvidia.com/gpu" not in res.get("requests", {})
            devices = int(res["requests"]["cpu"])
        else:
            assert gpus >= 1 and res["requests"].get("nvidia.com/gpu") == res["limits"]["nvidia.com/gpu"]
            devices = gpus
        # afore serve's own check: the workers of this pod's role (A + F, F or A) fit its devices
        # or --colocate is given; it refuses to start otherwise
        check_shape(opts, _Experts(opts.ffn_workers), devices)


def test_h200_profile_is_one_worker_per_gpu():
    docs = render("h200-x8")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    opts = pod_options(lws, docs)
    gpus = int(serve_container(lws)["resources"]["limits"]["nvidia.com/gpu"])
    assert (opts.device, opts.attn_workers, opts.ffn_workers, gpus, opts.colocate) == ("cuda", 4, 4, 8, False)
    assert opts.model.startswith("/models/")
    mounts = {m["mountPath"] for m in serve_container(lws)["volumeMounts"]}
    assert "/models" in mounts


def test_cpu_tiny_profile_is_the_built_in_model_on_cpu():
    docs = render("cpu-tiny")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    opts = pod_options(lws, docs)
    assert (opts.model, opts.device, opts.colocate) == ("", "cpu", True)


def _port(container: dict, port) -> int:
    return {p["name"]: p["containerPort"] for p in container["ports"]}[port] if isinstance(port, str) else port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_graceful_termination(overlay):
    docs = render(overlay)
    for lws, index in pods(docs):
        c = serve_container(lws, index)
        opts = pod_options(lws, docs, index)
        where = f"{overlay}/{lws['metadata']['name']} pod {index} (role {opts.role})"
        if opts.role == "ffn":
            # no vLLM on the FFN node: its admin endpoint answers once the node is started, and
            # the launcher exits 1 when an FFN worker dies
            for probe in ("startupProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert (get["path"], _port(c, get["port"])) == ("/afore/status", opts.admin), f"{where}: {probe}"
            assert "readinessProbe" not in c or c["readinessProbe"]["httpGet"]["path"] == "/afore/status"
        else:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert (get["path"], _port(c, get["port"])) == ("/health", opts.port), f"{where}: {probe} must ask vLLM's /health"
        # the startup probe covers afore serve's start: --start-timeout per phase; the attention
        # node has two waits before /health (the FFN node's workers, then vLLM)
        start = c["startupProbe"]
        phases = 2 if opts.role == "attention" else 1
        assert start["periodSeconds"] * start["failureThreshold"] >= phases * opts.start_timeout_s, where
        # afore/serve/launcher.py shutdown(): vLLM 30 s, each FFN worker 10 s, the scheduler 10 s,
        # of what runs in this pod
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        needed = pre_stop + {"all": 30 + 10 * opts.ffn_workers + 10, "ffn": 10 * opts.ffn_workers + 10,
                             "attention": 30}[opts.role]
        grace = pod_template(lws, index)["spec"]["terminationGracePeriodSeconds"]
        assert grace >= needed, f"{where}: terminationGracePeriodSeconds {grace} < {needed}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_image_is_set_by_kustomize(overlay):
    for lws, index in pods(render(overlay)):
        image = serve_container(lws, index)["image"]
        assert ":" in image, f"{overlay}: image {image!r} has no tag (kustomize images: did not apply)"


# ---------------------------------------------------------------- the two-node replica


def test_two_node_group_is_an_ffn_leader_and_an_attention_worker():
    docs = render("h200-2node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and "leaderTemplate" in group
    # one node failing restarts both: the FFN node exits when the attention node goes away
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    ffn, attn = pod_options(lws, docs, 0), pod_options(lws, docs, 1)
    assert (ffn.role, attn.role) == ("ffn", "attention")
    # the attention node finds the FFN node at the leader pod's address, which LWS injects
    assert "--ffn-host=$(LWS_LEADER_ADDRESS)" in serve_container(lws, 1)["args"]
    assert attn.ffn_host == leader_address(lws)
    # what the two halves must agree on
    shared = ("model", "attn_workers", "ffn_workers", "store_port", "demand_port", "device", "dtype", "microbatches")
    assert {f: getattr(ffn, f) for f in shared} == {f: getattr(attn, f) for f in shared}
    assert (ffn.attn_workers, ffn.ffn_workers, ffn.device) == (8, 8, "cuda")
    assert (ffn.store_port, ffn.demand_port) == (29600, 29601)
    assert ffn.model.startswith("/models/")
    assert ffn.policy == {d["metadata"]["name"]: d for d in of_kind(docs, "ConfigMap")}[
        next(e for e in serve_container(lws, 0)["env"] if e["name"] == "AFORE_POLICY")["valueFrom"]["configMapKeyRef"]["name"]
    ]["data"]["AFORE_POLICY"]


def test_two_node_gpus_are_one_worker_each():
    docs = render("h200-2node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    ffn, attn = pod_options(lws, docs, 0), pod_options(lws, docs, 1)
    gpus = [int(serve_container(lws, i)["resources"]["limits"]["nvidia.com/gpu"]) for i in (0, 1)]
    # F FFN workers on the leader's GPUs, A attention engines on the worker's: no sharing
    assert gpus == [ffn.ffn_workers, attn.attn_workers] == [8, 8]
    assert not ffn.colocate and not attn.colocate


def test_two_node_pods_expose_the_ports_of_their_role():
    docs = render("h200-2node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    ffn, attn = pod_options(lws, docs, 0), pod_options(lws, docs, 1)
    leader = {p["name"]: p["containerPort"] for p in serve_container(lws, 0)["ports"]}
    worker = {p["name"]: p["containerPort"] for p in serve_container(lws, 1)["ports"]}
    # the attention node dials the store and the demand receiver at the leader's address
    assert sorted(leader.values()) == sorted([ffn.store_port, ffn.demand_port, ffn.admin])
    assert attn.store_port in leader.values() and attn.demand_port in leader.values()
    assert sorted(worker.values()) == sorted([attn.port, attn.admin])


def test_two_node_pods_share_the_demand_token_secret():
    docs = render("h200-2node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    refs = []
    for index in (0, 1):
        c = serve_container(lws, index)
        (entry,) = [e for e in c["env"] if e["name"] == "AFORE_DEMAND_TOKEN"]
        assert "value" not in entry, "the token must come from the Secret, not the manifest"
        refs.append(entry["valueFrom"]["secretKeyRef"])
        # afore serve reads it from the environment; an argument would show it in the process list
        assert not any("AFORE_DEMAND_TOKEN" in a for a in c["args"])
    assert refs[0] == refs[1] == {"name": "afore-demand-token", "key": "token"}


def test_two_node_pods_are_the_h200_pod():
    """Each node's pod is the h200-x8 pod (model PVC, /dev/shm, pid namespace, security,
    termination, resources, placement); only the role's args, ports, probes and the token differ."""
    ref = pod_template(of_kind(render("h200-x8"), "LeaderWorkerSet")[0])["spec"]
    (lws,) = of_kind(render("h200-2node"), "LeaderWorkerSet")
    same_pod = ("volumes", "shareProcessNamespace", "securityContext", "terminationGracePeriodSeconds",
                "nodeSelector", "tolerations")
    same_container = ("image", "resources", "volumeMounts", "securityContext", "lifecycle")
    for index in (0, 1):
        spec = pod_template(lws, index)["spec"]
        for f in same_pod:
            assert spec.get(f) == ref.get(f), f"pod {index}: {f}"
        c = serve_container(lws, index)
        for f in same_container:
            assert c.get(f) == ref["containers"][0].get(f), f"pod {index}: container {f}"


def test_two_node_services_split_api_and_admin():
    docs = render("h200-2node")
    (lws,) = of_kind(docs, "LeaderWorkerSet")
    selected = {}
    for svc in of_kind(docs, "Service"):
        selector = svc["spec"]["selector"]
        selected[svc["metadata"]["name"]] = [i for i in (0, 1)
                                             if all(pod_labels(lws, i).get(k) == v for k, v in selector.items())]
    # the OpenAI API on the attention pod; the policy switch on the FFN (leader) pod
    assert selected == {"afore-api": [1], "afore-admin": [0]}


# ---------------------------------------------------------------- A/B


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
