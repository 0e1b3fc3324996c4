"""One host of a two-host engine on loopback (tests/parallel/test_multihost.py starts two).

    multihost_driver.py RANK PORT MODEL_DIR REPORT

Every rank builds the same 4-way engine over both hosts' 2 CPU devices. Rank 0 generates
greedily, writes the tokens and the mesh to REPORT, then idles as a server between requests
would; rank 1 never returns from LLM(...): it runs rank 0's steps until rank 0 ends.
"""

import json
import sys
import time

from jaxserve import LLM, SamplingParams
from tests.parallel.tp_probe import TINY_PROMPTS, TINY_SHAPES

rank, port, model_dir, report = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
llm = LLM(model_dir, **TINY_SHAPES, tensor_parallel_size=4, num_hosts=2, host_rank=rank,
          coordinator_address=f"127.0.0.1:{port}", host_timeout_s=10.0)
outs = llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0), use_tqdm=False)
s = llm.stats()
with open(report + ".tmp", "w") as f:
    json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "prompts": [o.prompt_token_ids for o in outs],
               "mesh": {"devices": s.mesh_num_devices, "hosts": s.mesh_num_hosts,
                        "axis_sizes": dict(s.mesh_axis_sizes)}}, f)
import os  # noqa: E402

os.replace(report + ".tmp", report)
print("generated", flush=True)
time.sleep(float(os.environ.get("IDLE_S", "600")))   # idle, as a server between requests
