"""The engine's choices and limits that flags and configs offer (`--attention-backend`,
`--speculative-method`, `--graph-capture-k`): the public place pdspec/ and the nodes read them
from, so that no caller imports them out of the modules that implement them (docs/design.md §1)."""

from sampling.tree import MAX_TREE_NODES

ATTENTION_BACKENDS = ("auto", "triton", "sdpa")  # engine/paged_lm.py: attention_backend
SPECULATIVE_METHODS = ("draft", "prompt-lookup", "hybrid", "eagle")  # engine/proposers.py: proposer_for
ADAPTIVE_K = ("auto", "on", "off")  # engine/spec_config.py: SpeculativeConfig.adaptive
ASYNC_SCHEDULING = ("auto", "on", "off")  # decode_node/engine.py: DecodeConfig.pipelined
SPECULATE_AHEAD = ("off", "on")  # decode_node/config.py: DecodeConfig.speculate_ahead
# Tokens per row of a forward replayed from a CUDA graph (engine/paged_lm.py), at most: the
# verify pass of the largest tree
MAX_GRAPH_QUERIES = MAX_TREE_NODES + 1
