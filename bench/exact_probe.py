"""`python bench/exact_probe.py MODE DTYPE`: plain vLLM against `afore serve --exact` (A=1, F=2, policy afore) on
the built-in tiny Qwen3-MoE, greedy with logprobs, one request at a time; MODE `eager` adds
--enforce-eager, `compile` leaves vLLM its torch.compile (and, on a GPU, CUDA graphs). Prints
whether each prompt's tokens are identical and the largest logprob difference. A diagnostic of
--exact numerics beyond what the test suite covers (fp32 eager on CPU).
"""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "serve"))
from servers import Server, free_port_pair
from afore.models.tiny import build_tiny_checkpoint
model = str(build_tiny_checkpoint("qwen3_moe", seed=0))
if len(sys.argv) < 2 or sys.argv[1] not in ("eager", "compile") or (len(sys.argv) > 2 and sys.argv[2] not in ("bfloat16", "float32")):
    sys.exit("usage: python bench/exact_probe.py eager|compile [bfloat16|float32]")
mode = sys.argv[1]
eager = ["--enforce-eager"] if mode == "eager" else []
common = ["--dtype", sys.argv[2] if len(sys.argv) > 2 else "bfloat16", "--max-model-len", "512", "--seed", "0", *eager]
p1 = free_port_pair()
t0 = time.time()
plain = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(p1), *common], p1, f"/tmp/afore-exact-probe-plain-{mode}-{common[1]}.log")
print("plain up", time.time() - t0, flush=True)
want = plain.greedy(); plain.stop()
p2 = free_port_pair()
af = Server([sys.executable, "-m", "afore.cli", "serve", "--model", model, "--port", str(p2), "--attn-workers", "1", "--ffn-workers", "2", "--policy", "afore", "--exact", *common], p2, f"/tmp/afore-exact-probe-afore-{mode}-{common[1]}.log")
print("afore up", time.time() - t0, flush=True)
got = af.greedy(); af.stop()
same = [g["ids"] == w["ids"] for g, w in zip(got, want)]
worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g["logprobs"], w["logprobs"]) if a is not None and b is not None)
print(json.dumps({"mode": mode, "dtype": common[1], "identical": same, "max_logprob_diff": worst}))
