"""Benchmarks (`duplex bench ...`): the project's measuring instrument.

cli        the `duplex bench` dispatcher (lazy: each subcommand imports only its module)
serve      `bench serve`: drive an OpenAI-compatible server; `run_workload` for other code
runner     the load generator: closed loop, open loop (Poisson / gamma), trace replay
client     one streamed chat completion → a RequestRecord (every fault becomes a status)
record     RequestRecord: one request's timeline
metrics    TTFT, TPOT, ITL, e2e, throughput, goodput, cache hit rate, speculative acceptance
workloads  random, shared-prefix, multi-turn, agent, mooncake
text       exact-length text from the built-in corpus (corpus)
report     JSON result files, Markdown summaries, CDF and sweep plots
compare    `bench compare`: summaries side by side with ratios
machine    measured GEMM GFLOP/s and memory bandwidth; decode utilization
hf         tokenizer / plain transformers model loading from GGUF or HF directories
baseline_server  `bench baseline-server`: transformers `generate` behind the OpenAI API
"""
