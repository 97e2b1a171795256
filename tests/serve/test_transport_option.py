"""``afore serve --transport``: the A2F/F2A backend is chosen once and both sides get the same one."""

from __future__ import annotations

import json

import pytest

from afore.attention.role import CONFIG_ENV, AttentionRoleConfig
from afore.serve.launcher import ServeOptions, check_shape, exchange_mode, read_serving_spec, transport_backend, uses_shm
from servers import tiny


def test_auto_is_gloo_on_cpu_and_on_a_shared_gpu_else_nccl():
    assert transport_backend(ServeOptions(), devices=8) == "gloo"
    assert transport_backend(ServeOptions(device="cuda", colocate=True), devices=1) == "gloo"   # A+F=3 on 1 GPU
    assert transport_backend(ServeOptions(device="cuda"), devices=3) == "nccl"
    assert transport_backend(ServeOptions(device="cuda", transport="torch-gloo"), devices=8) == "gloo"
    assert transport_backend(ServeOptions(device="cuda", transport="torch-nccl"), devices=8) == "nccl"
    # a split role cannot see the other node's GPUs: auto stays NCCL so both nodes agree
    split = ServeOptions(device="cuda", role="ffn", host="0.0.0.0", store_port=29600, ffn_workers=4, colocate=True)
    assert transport_backend(split, devices=1) == "nccl"


def test_auto_is_shm_where_the_workers_share_the_device_and_exact_follows_it():
    """``--transport auto``: shm on one node whose workers share the device (CPU; cuda with
    --colocate), torch.distributed otherwise; ``--exact`` unset is on exactly where vLLM's
    numerics need it and the layout allows it (cuda, shm, one microbatch), and an explicit
    ``--no-exact`` / ``--exact`` wins."""
    from afore.cli import build_parser
    from afore.serve.cli import options_from_args

    def opts(*argv):
        return options_from_args(build_parser().parse_args(["serve", *argv]))

    readme = opts("--device", "cuda", "--attn-workers", "1", "--ffn-workers", "2", "--colocate")
    assert uses_shm(readme) and readme.exact is True and readme.microbatches == 1 and exchange_mode(readme) == "stream"
    assert opts("--device", "cuda", "--colocate", "--no-exact").exact is False
    assert opts("--device", "cuda", "--colocate", "--exact").exact is True
    assert opts("--device", "cuda", "--colocate", "--microbatches", "2").exact is False  # ping-pong: vLLM's kernel choice differs
    own_gpus = opts("--device", "cuda")
    assert not uses_shm(own_gpus) and own_gpus.exact is False  # NCCL: per-token sums
    assert opts("--device", "cuda", "--colocate", "--transport", "torch-gloo").exact is False
    cpu = opts()
    assert uses_shm(cpu) and cpu.exact is False and exchange_mode(cpu) == "host"
    assert opts("--exact").exact is True
    split = ServeOptions(device="cuda", role="ffn", host="0.0.0.0", store_port=29600, colocate=True)
    assert not uses_shm(split) and split.exact is False
    with pytest.raises(ValueError, match="exact: --exact needs one microbatch"):
        opts("--device", "cuda", "--colocate", "--exact", "--microbatches", "2")


def test_nccl_on_a_shared_gpu_and_unknown_transports_are_refused():
    info, _ = read_serving_spec(tiny("qwen3_moe"))
    with pytest.raises(ValueError, match="transport: NCCL cannot hold several workers on one GPU"):
        check_shape(ServeOptions(device="cuda", colocate=True, transport="torch-nccl"), info, devices=1)
    check_shape(ServeOptions(device="cuda", colocate=True, transport="torch-gloo"), info, devices=1)
    with pytest.raises(ValueError, match="transport: torch-nccl needs --device cuda"):
        ServeOptions(transport="torch-nccl")
    with pytest.raises(ValueError, match="transport: expected one of auto, .*torch-nccl, torch-gloo"):
        ServeOptions(transport="rdma")
    with pytest.raises(ValueError, match="backend"):
        AttentionRoleConfig(num_experts=8, top_k=2, attn_workers=1, ffn_workers=2, moe_layers=[0], store_port=1,
                            hidden=8, backend="mpi")


def test_ffn_workers_and_the_attention_side_get_the_same_backend(monkeypatch, started):
    import afore.serve.launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "device_count", lambda device: 1)
    opts = ServeOptions(device="cuda", colocate=True, transport="torch-gloo", store_port=29600)
    launcher = launcher_mod.Launcher(opts)
    launcher.model = tiny("qwen3_moe")
    launcher.spec, launcher.config = read_serving_spec(launcher.model)
    launcher.backend = transport_backend(opts, 1)
    launcher.dtype = "float32"
    launcher.start_ffn_workers()
    launcher.start_server()
    workers = [json.loads(cmd[cmd.index("--config-json") + 1]) for cmd, _ in started if "ffn-worker" in cmd]
    assert len(workers) == 2
    assert all(w["backend"] == "gloo" and w["device"] == "cuda:0" for w in workers)
    role = json.loads(started[-1][1][CONFIG_ENV])
    assert role["backend"] == "gloo" and role["device"] == "cuda"


def test_the_transport_listens_where_the_node_is_reached(monkeypatch, started):
    """Role all keeps the store and the gloo/NCCL data plane on the node (loopback, also under a
    wildcard --host); role ffn listens on --host (a wildcard: the store on every interface, the
    data plane where gloo/NCCL choose); the attention node pins the interface it reaches the FFN
    node from. Every child gets the interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)."""
    import afore.serve.launcher as launcher_mod
    from afore.transport.network import IFNAME_ENV, interface_of

    for name in IFNAME_ENV:
        monkeypatch.delenv(name, raising=False)
    loopback = interface_of("127.0.0.1")
    cases = [(ServeOptions(transport="torch-gloo"), "127.0.0.1", loopback),
             (ServeOptions(transport="torch-gloo", host="0.0.0.0"), "127.0.0.1", loopback),
             (ServeOptions(role="ffn", host="0.0.0.0", store_port=29600), "127.0.0.1", None),
             (ServeOptions(role="attention", ffn_host="127.0.0.1", store_port=29600), "127.0.0.1", loopback)]
    for opts, store_host, interface in cases:
        started.clear()
        launcher = launcher_mod.Launcher(opts)
        launcher.model = tiny("qwen3_moe")
        launcher.spec, launcher.config = read_serving_spec(launcher.model)
        launcher.backend, launcher.dtype = "gloo", "float32"
        if opts.role != "attention":
            launcher.start_ffn_workers()
        if opts.role != "ffn":
            launcher.start_server()
        hosts = [json.loads(cmd[cmd.index("--config-json") + 1])["host"] for cmd, _ in started if "ffn-worker" in cmd]
        hosts += [json.loads(env[CONFIG_ENV])["store_host"] for _, env in started if CONFIG_ENV in env]
        assert hosts and set(hosts) == {store_host}, (opts.role, opts.host, hosts)
        for _, env in started:
            assert [env.get(name) for name in IFNAME_ENV] == [interface] * 2, (opts.role, opts.host)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # set by hand: kept
    assert launcher.child_env()["NCCL_SOCKET_IFNAME"] == "ib0"


def _start_on_tiny(launcher) -> None:
    """Start ``launcher``'s FFN workers and vLLM server (recorded by ``started``) on the tiny
    Qwen3-MoE, gloo, float32."""
    launcher.model = tiny("qwen3_moe")
    launcher.spec, launcher.config = read_serving_spec(launcher.model)
    launcher.backend = "gloo"
    launcher.dtype = "float32"
    launcher.start_ffn_workers()
    launcher.start_server()


def test_exact_needs_shm_and_one_microbatch_and_reaches_both_sides(monkeypatch, started):
    """``--exact``: refused with a transport whose replies are per-token sums or with two
    microbatches (vLLM picks its kernels by the call's token count); otherwise the FFN workers,
    the attention side and the segment all get it."""
    from afore.cli import build_parser
    from afore.serve.cli import options_from_args

    with pytest.raises(ValueError, match="exact: --exact needs --transport shm"):
        ServeOptions(exact=True, transport="torch-gloo")
    with pytest.raises(ValueError, match="exact: --exact needs one microbatch"):
        ServeOptions(exact=True, transport="shm", microbatches=2)
    assert options_from_args(build_parser().parse_args(["serve", "--exact", "--device", "cuda", "--transport", "shm"])).microbatches == 1
    import afore.serve.launcher as launcher_mod

    _start_on_tiny(launcher_mod.Launcher(ServeOptions(exact=True, transport="shm", store_port=29600)))
    workers = [json.loads(cmd[cmd.index("--config-json") + 1]) for cmd, _ in started if "ffn-worker" in cmd]
    assert len(workers) == 2 and all(w["exact"] and w["shm_segment"] for w in workers)
    assert json.loads(started[-1][1][CONFIG_ENV])["exact"] is True


def test_exact_on_cpu_warns_outside_float32():
    """``--exact`` on the CPU holds in float32 only (bench/exact_probe.py): other dtypes get a
    warning naming the fix; float32 and CUDA get none."""
    from afore.serve.launcher import exact_caveat

    opts = ServeOptions(exact=True, transport="shm")
    assert "--dtype float32" in exact_caveat(opts, "bfloat16")
    assert exact_caveat(opts, "float32") is None
    assert exact_caveat(ServeOptions(exact=True, transport="shm", device="cuda"), "bfloat16") is None
    assert exact_caveat(ServeOptions(transport="shm"), "bfloat16") is None


@pytest.mark.parametrize("argv,pingpong", [([], True), (["--no-pingpong"], False)])
def test_pingpong_option_reaches_the_attention_side(started, argv, pingpong):
    """``--microbatches 2`` runs ping-pong microbatches unless ``--no-pingpong``: the attention
    workers' AFORE_CONFIG carries the choice (the plugin installs the split from it)."""
    from afore.cli import build_parser
    from afore.serve.cli import options_from_args
    import afore.serve.launcher as launcher_mod

    opts = options_from_args(build_parser().parse_args(["serve", "--microbatches", "2", "--transport", "shm",
                                                        "--store-port", "29600", *argv]))
    assert opts.microbatches == 2 and opts.pingpong is pingpong
    _start_on_tiny(launcher_mod.Launcher(opts))
    role = json.loads(started[-1][1][CONFIG_ENV])
    assert role["microbatches"] == 2 and role["pingpong"] is pingpong


def test_spin_is_off_unless_asked_and_bad_values_are_refused():
    """``--spin-us``: 0 (every wait blocks) unless set; negative or non-finite values are refused
    on both the launcher's options and the attention role's config."""
    from afore.serve.launcher import spin_seconds

    assert spin_seconds(ServeOptions()) == 0.0
    assert spin_seconds(ServeOptions(device="cuda", colocate=True)) == 0.0
    assert spin_seconds(ServeOptions(spin_us=300.0)) == pytest.approx(300e-6)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="spin_us: expected microseconds >= 0"):
            ServeOptions(spin_us=bad)
    with pytest.raises(ValueError, match="spin_us"):
        AttentionRoleConfig(num_experts=8, top_k=2, attn_workers=1, ffn_workers=2, moe_layers=[0], store_port=1,
                            hidden=8, spin_us=-1.0)


def test_spin_option_reaches_every_waiting_process(monkeypatch, started):
    """``--spin-us 750``: the attention workers' AFORE_CONFIG, every FFN worker's config and the
    scheduler's ServiceConfig carry it (each passes it to its shm / plan-ring / mailbox waits)."""
    from afore.cli import build_parser
    from afore.serve.cli import options_from_args
    import afore.scheduler.service as service_mod
    import afore.serve.launcher as launcher_mod

    opts = options_from_args(build_parser().parse_args(["serve", "--transport", "shm", "--store-port", "29600",
                                                        "--spin-us", "750"]))
    assert opts.spin_us == 750.0
    launcher = launcher_mod.Launcher(opts)
    _start_on_tiny(launcher)
    workers = [json.loads(cmd[cmd.index("--config-json") + 1]) for cmd, _ in started if "ffn-worker" in cmd]
    assert len(workers) == 2 and all(w["spin_us"] == pytest.approx(750.0) for w in workers)
    assert json.loads(started[-1][1][CONFIG_ENV])["spin_us"] == pytest.approx(750.0)
    configs = []
    monkeypatch.setattr(service_mod, "start_scheduler_process", lambda cfg, **kw: configs.append(cfg) or object())
    launcher.start_scheduler("afore")
    assert configs[0].spin_us == pytest.approx(750.0)
    # unset: nothing spins
    default = options_from_args(build_parser().parse_args(["serve", "--transport", "shm", "--store-port", "29600"]))
    assert default.spin_us == 0.0 and launcher_mod.spin_seconds(default) == 0.0


def test_planner_workers_reaches_the_ffn_workers_and_starts_no_demand_path(started):
    """``--planner workers``: every FFN worker gets the policy, its params and the calibrated cost
    and no plan ring; the attention side gets no demand mailbox (nothing would read it). The
    default keeps the scheduler's ring and mailbox."""
    from afore.cli import build_parser
    from afore.serve.cli import options_from_args
    import afore.serve.launcher as launcher_mod

    argv = ["serve", "--transport", "shm", "--store-port", "29600", "--policy", "eplb", "--copy-budget", "3"]
    opts = options_from_args(build_parser().parse_args([*argv, "--planner", "workers"]))
    assert opts.planner == "workers"
    launcher = launcher_mod.Launcher(opts)
    _start_on_tiny(launcher)
    workers = [json.loads(cmd[cmd.index("--config-json") + 1]) for cmd, _ in started if "ffn-worker" in cmd]
    assert len(workers) == 2
    assert all(w["policy"] == "eplb" and w["plan_ring"] == "" and w["params"]["copy_budget"] == 3 for w in workers)
    assert workers[0]["cost"] == workers[1]["cost"] and workers[0]["cost"]["bytes_per_expert"] > 0
    assert json.loads(started[-1][1][CONFIG_ENV])["mailbox"] == ""
    started.clear()
    _start_on_tiny(launcher_mod.Launcher(options_from_args(build_parser().parse_args(argv))))
    workers = [json.loads(cmd[cmd.index("--config-json") + 1]) for cmd, _ in started if "ffn-worker" in cmd]
    assert all(w["policy"] == "" and w["plan_ring"].endswith("-plans") for w in workers)
    assert json.loads(started[-1][1][CONFIG_ENV])["mailbox"].endswith("-demand")


def test_planner_workers_is_healthy_without_a_scheduler_and_switches_on_the_board(started):
    """No scheduler process: /health is fine and reports the planner; a policy switch posts the
    policy on the board the FFN workers read (made when they start, named in their configs), and
    the board goes with the launcher's stop."""
    import os

    import afore.serve.launcher as launcher_mod
    from afore.scheduler.policy_board import PolicyReader

    launcher = launcher_mod.Launcher(ServeOptions(planner="workers", policy="afore", transport="shm", store_port=29600))
    code, body = launcher.health()
    assert code == 200 and body["scheduler"] == {"state": "workers"}
    assert launcher.status()["planner"] == "workers"
    with pytest.raises(ValueError, match="policy: the FFN workers are not started yet"):
        launcher.switch_policy("eplb")
    _start_on_tiny(launcher)
    workers = [json.loads(cmd[cmd.index("--config-json") + 1]) for cmd, _ in started if "ffn-worker" in cmd]
    assert {w["policy_board"] for w in workers} == {launcher.board_name}
    reader = PolicyReader(launcher.board_name)
    try:
        assert reader.changed() == (1, "afore") and reader.changed() is None
        launcher.switch_policy("eplb")
        assert launcher.policy == "eplb" and launcher.status()["policy"] == "eplb"
        assert reader.changed() == (2, "eplb")
        with pytest.raises(ValueError, match="policy: expected one of"):
            launcher.switch_policy("best")
        assert reader.changed() is None and launcher.policy == "eplb"
    finally:
        reader.close()
        launcher.ffn, launcher.server = [], None  # recorded, never started: nothing to stop but the segments
        launcher.shutdown()
    assert not os.path.exists(f"/dev/shm/{launcher.board_name}")
    # the scheduler's planner without its process is degraded, as before
    assert launcher_mod.Launcher(ServeOptions()).health()[0] == 503


def test_bad_planner_settings_are_refused():
    from afore.ffn.worker import FFNWorkerConfig

    with pytest.raises(ValueError, match="planner: expected one of scheduler, workers, attention, got 'gpu'"):
        ServeOptions(planner="gpu")
    with pytest.raises(ValueError, match="planner: --planner workers needs every worker on one node"):
        ServeOptions(planner="workers", role="ffn", host="0.0.0.0", store_port=29600)
    with pytest.raises(ValueError, match="planner: --planner workers on cuda needs --transport shm"):
        ServeOptions(planner="workers", device="cuda", transport="torch-gloo")
    ServeOptions(planner="workers", device="cuda", transport="shm")
    with pytest.raises(ValueError, match="planner: --planner attention needs one attention worker.*--attn-workers 2"):
        ServeOptions(planner="attention", attn_workers=2)
    with pytest.raises(ValueError, match="planner: --planner attention needs one attention worker.*--role ffn"):
        ServeOptions(planner="attention", role="ffn", host="0.0.0.0", store_port=29600)
    with pytest.raises(ValueError, match="exchange: --planner attention plans on the host exchange's path"):
        ServeOptions(planner="attention", device="cuda", transport="shm", exchange="stream")
    # auto: the host exchange where the attention worker plans (stream otherwise on cuda + shm)
    assert exchange_mode(ServeOptions(planner="attention", device="cuda", transport="shm")) == "host"
    assert exchange_mode(ServeOptions(device="cuda", transport="shm")) == "stream"
    base = dict(rank=0, num_ffn=2, num_attention=1, model="m")
    with pytest.raises(ValueError, match="policy: expected one of .*afore.*, got 'best'"):
        FFNWorkerConfig(**base, policy="best")
    with pytest.raises(ValueError, match="policy, plan_ring: expected one planner"):
        FFNWorkerConfig(**base, policy="afore", plan_ring="afore-plans")
    with pytest.raises(ValueError, match="policy: the replicated planner needs each target's ids on the host"):
        FFNWorkerConfig(**base, policy="afore", device="cuda:0")
    FFNWorkerConfig(**base, policy="afore", device="cuda:0", shm_segment="seg", max_tokens=8)


def test_vllm_on_cpu_beside_the_ffn_workers_gets_a_passive_openmp_wait(monkeypatch, started):
    """On one CPU node vLLM's engine shares its cores with the FFN workers: its OpenMP team
    sleeps after each parallel region instead of spinning (OMP_WAIT_POLICY=PASSIVE); a user's own
    setting wins; the attention node of a split (FFN workers elsewhere) and GPUs keep the default."""
    import afore.serve.launcher as launcher_mod

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _start_on_tiny(launcher_mod.Launcher(ServeOptions(transport="shm", store_port=29600)))
    assert started[-1][1]["OMP_WAIT_POLICY"] == "PASSIVE"
    started.clear()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _start_on_tiny(launcher_mod.Launcher(ServeOptions(transport="shm", store_port=29600)))
    assert started[-1][1]["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    started.clear()
    launcher = launcher_mod.Launcher(ServeOptions(role="attention", ffn_host="127.0.0.1", store_port=29600,
                                                  transport="torch-gloo"))
    launcher.model = tiny("qwen3_moe")
    launcher.spec, launcher.config = read_serving_spec(launcher.model)
    launcher.backend, launcher.dtype = "gloo", "float32"
    launcher.start_server()
    assert "OMP_WAIT_POLICY" not in started[-1][1]
