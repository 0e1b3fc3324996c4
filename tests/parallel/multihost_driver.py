"""One host of a two-host engine on loopback (tests/parallel/test_multihost.py starts two).

    multihost_driver.py RANK PORT MODEL_DIR REPORT        (env: CACHE_DIR, COMPILE_LOG, IDLE_S)

Every rank builds the same 4-way engine over both hosts' 2 CPU devices. Rank 0 generates
greedily, writes the tokens and the mesh to REPORT, then idles as a server between requests
would; rank 1 never returns from LLM(...): it runs rank 0's steps until rank 0 ends.
"""

import json
import os
import sys
import time

from jaxserve import LLM, SamplingParams
from tests.parallel.tp_probe import TINY_PROMPTS, TINY_SHAPES

rank, port, model_dir, report = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
# CACHE_DIR: keep executables there (a second start loads them); COMPILE_LOG: a line per step or
# sampler this rank compiles (a miss of the executable cache), written as it happens
shapes = {**TINY_SHAPES, "cache_dir": os.environ.get("CACHE_DIR", "")}
if os.environ.get("COMPILE_LOG"):
    from jaxserve.runner import programs

    keep = programs.compile_to_keep

    def logged(lowered, *args, **kwargs):
        with open(os.environ["COMPILE_LOG"], "a") as log:
            log.write("compiled\n")
        return keep(lowered, *args, **kwargs)

    programs.compile_to_keep = logged
llm = LLM(model_dir, **shapes, tensor_parallel_size=4, num_hosts=2, host_rank=rank,
          coordinator_address=f"127.0.0.1:{port}", host_timeout_s=10.0)
outs = llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0), use_tqdm=False)
s = llm.stats()
with open(report + ".tmp", "w") as f:
    json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "prompts": [o.prompt_token_ids for o in outs],
               "mesh": {"devices": s.mesh.num_devices, "hosts": s.mesh.num_hosts,
                        "axis_sizes": dict(s.mesh.axis_sizes)}}, f)
os.replace(report + ".tmp", report)
print("generated", flush=True)
time.sleep(float(os.environ.get("IDLE_S", "600")))   # idle, as a server between requests
