"""A node process moves what its start-up left alive out of the garbage collector's reach
(pdspec.serving.freeze_start_up): a full collection then walks only what serving made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A node's start-up as serve_until_signal runs it: the context is entered (start-up), the node
# serves until SIGTERM (sent from start-up itself: the handler sets the stop at once), then the
# context is left, where what the collector sees is recorded.
NODE = """
import contextlib, gc, json, os, signal, weakref
from pdspec.serving import serve_until_signal

class Part:
    pass

@contextlib.contextmanager
def node():
    kept = [Part() for _ in range(1000)]  # what the node holds while it serves
    dropped = Part()
    dropped.itself = dropped  # start-up's garbage: a cycle that only a full collection frees,
    gc.collect()  # once it is in the oldest generation (it lived through start-up)
    gone = weakref.ref(dropped)
    del dropped
    os.kill(os.getpid(), signal.SIGTERM)
    yield
    seen = {id(o) for o in gc.get_objects()}  # the permanent generation is not among them
    print(json.dumps({
        "frozen": gc.get_freeze_count(),
        "kept_frozen": not any(id(part) in seen for part in kept),
        "garbage_collected": gone() is None,
    }))

serve_until_signal(node(), "test")
"""


def test_a_serving_node_freezes_what_start_up_left_alive_and_collects_the_rest():
    done = subprocess.run([sys.executable, "-c", NODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["frozen"] >= 1000, found
    assert found["kept_frozen"], found
    assert found["garbage_collected"], found
