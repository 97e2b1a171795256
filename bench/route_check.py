"""E2E routing check (docs/affinity.md): the same prompt mix sent directly to afore serve (vLLM's DP balancing) and
through afore route (token cost); per-engine prompt tokens from vLLM's /metrics, TTFT per request.

  python bench/route_check.py http://127.0.0.1:8310 http://127.0.0.1:8320   # API of afore serve, API of afore route
"""
import asyncio, json, re, sys, time, urllib.request
import aiohttp

API, ROUTE = sys.argv[1], sys.argv[2]
MODEL = json.load(urllib.request.urlopen(API + "/v1/models"))["data"][0]["id"]
LONG = " ".join(f"word{i}" for i in range(200))
SHORT = "def add(a, b):"
PROMPTS = [LONG if i % 4 == 0 else SHORT for i in range(24)]

def engine_prompt_tokens():
    text = urllib.request.urlopen(API + "/metrics").read().decode()
    out = {}
    for m in re.finditer(r'^vllm:prompt_tokens_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        eng = re.search(r'engine="(\d+)"', m.group(1))
        if eng: out[int(eng.group(1))] = out.get(int(eng.group(1)), 0) + float(m.group(2))
    return out

async def one(session, url, prompt):
    t0 = time.perf_counter(); ttft = None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: ") and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0

async def run(url, label):
    before = engine_prompt_tokens()
    async with aiohttp.ClientSession() as s:
        sem = asyncio.Semaphore(8)
        async def lim(p):
            async with sem:
                return await one(s, url, p)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(lim(p) for p in PROMPTS))
        wall = time.perf_counter() - t0
    after = engine_prompt_tokens()
    per_engine = {e: after.get(e, 0) - before.get(e, 0) for e in sorted(after)}
    ttft = sorted(r[0] for r in res)
    out = {"label": label, "per_engine_prompt_tokens": per_engine, "ttft_p50_s": ttft[len(ttft)//2], "ttft_max_s": ttft[-1],
           "latency_max_s": max(r[1] for r in res), "wall_s": wall}
    print(json.dumps(out)); return out

async def main():
    results = [await run(API, "direct: vLLM DP balancing"), await run(ROUTE, "afore route: token-cost")]
    state = json.load(urllib.request.urlopen(ROUTE + "/afore/router"))
    print(json.dumps({"router": {k: v for k, v in state.items() if k != "decisions"},
                      "decisions": [(d["request"], d["engine"], d["prompt_tokens"], d["outstanding_tokens_before"]) for d in state["decisions"]]}))
asyncio.run(main())
