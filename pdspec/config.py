"""Command-line flags that also read PDSPEC_<ROLE>_<FLAG> environment variables.

`--metrics-port` of the decode node is PDSPEC_DECODE_METRICS_PORT; a flag on the command
line wins over the environment, the environment over the default.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec_config import SpeculativeConfig


class EnvArgumentParser(argparse.ArgumentParser):
    def __init__(self, role: str, **kwargs) -> None:
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)
        self.role = role.upper()

    def env_name(self, flag: str) -> str:
        return f"PDSPEC_{self.role}_{flag.lstrip('-').replace('-', '_').upper()}"

    def add_flag(self, flag: str, *, default=None, type=str, help: str = "", **kwargs):
        """An option whose default comes from the environment when set there."""
        env = self.env_name(flag)
        raw = os.environ.get(env)
        if raw is not None:
            try:
                default = raw.lower() in ("1", "true", "yes", "on") if type is bool else type(raw)
            except (ValueError, argparse.ArgumentTypeError) as err:
                said = str(err) if repr(raw) in str(err) else f"{err}; got {raw!r}"
                self.error(f"{env} (the default of {flag}): {said}")
        if type is bool:
            return self.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=f"{help} [env {env}]", **kwargs
            )
        return self.add_argument(flag, default=default, type=type, help=f"{help} [env {env}]", **kwargs)


def node_parser(role: str, port: int, metrics_port: int, description: str) -> EnvArgumentParser:
    """The flags both nodes share; each node adds its own."""
    import pdspec
    from engine.options import ATTENTION_BACKENDS, SPECULATIVE_METHODS
    from sampling.proposal import DraftLaw

    parser = EnvArgumentParser(role, prog=f"python -m {role}_node", description=description)
    parser.add_argument("--version", action="version", version=f"pdspec {pdspec.__version__} ({role} node)")
    parser.add_flag("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    parser.add_flag("--log-format", default="text", choices=["text", "json"], help="text lines or one JSON per line")
    parser.add_flag(
        "--log-stats-seconds", default=10.0, type=float, help="period of the throughput/acceptance summary (0 = off)"
    )
    parser.add_flag("--host", default="0.0.0.0", help="address to bind (0.0.0.0: all interfaces; gRPC: [::], IPv6 too)")
    parser.add_flag("--port", default=port, type=int, help="gRPC port (0 = any free port)")
    parser.add_flag("--metrics-port", default=metrics_port, type=int, help="Prometheus /metrics port (-1 = off)")
    parser.add_flag("--corpus", default=None, type=Path, help="built-in pair's corpus (default: Python's stdlib)")
    parser.add_flag(
        "--target-model",
        default=None,
        help="smollm2-135m-instruct, a .gguf file or an HF checkpoint directory (default: the built-in pair)",
    )
    parser.add_flag("--draft-model", default=None, help="the draft: same forms as --target-model")
    parser.add_flag(
        "--draft-layers", default=None, type=int, help="draft = the target's first N layers (not with --draft-model)"
    )
    parser.add_flag("--device", default="cpu", help="cpu, cuda or cuda:N (ROCm: torch's HIP build, cuda names)")
    parser.add_flag(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="model dtype (cpu float32, cuda bf16)"
    )
    parser.add_flag("--kv-cache-bytes", default=None, type=int, help="KV pool size (default: by device)")
    parser.add_flag(
        "--gpu-memory-utilization",
        default=0.9,
        type=float,
        help="on a GPU without --kv-cache-bytes: this process's share of the device's memory, weights + KV pool "
        "(as in vLLM; it must fit in the memory free at start-up: two nodes on one GPU take e.g. 0.55 and 0.3)",
    )
    parser.add_flag(
        "--enforce-eager",
        default=False,
        type=bool,
        help="on a GPU: no CUDA graphs and no compiled elementwise kernels (debugging, or no Triton)",
    )
    parser.add_flag(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="paged attention on a GPU: the Triton kernel reading the pool in place, or SDPA over gathered "
        "blocks (auto: triton where Triton runs, unless --enforce-eager)",
    )
    parser.add_flag(
        "--graph-capture-batch",
        default=32,
        type=int,
        help="on a GPU: CUDA graphs of batches up to this many rows are captured at start-up, the others on "
        "first use (0: every graph on first use)",
    )
    parser.add_flag(
        "--graph-capture-context",
        default=2048,
        type=int,
        help="the start-up capture covers key widths up to this many keys (a row's context plus the tokens it brings)",
    )
    parser.add_flag(
        "--graph-capture-k",
        default=(4,),
        type=_int_list,
        help="comma-separated K whose verify passes (K+1 tokens per row) the start-up capture covers",
    )
    parser.add_flag(
        "--draft-sampling",
        default="point-mass",
        choices=[law.value for law in DraftLaw],
        help="how the draft proposes: top-1 point mass, or sampling with the request's parameters",
    )
    parser.add_flag(
        "--speculative-method",
        default="draft",
        choices=SPECULATIVE_METHODS,
        help="what proposes drafts: the draft model; prompt-lookup, the continuation of an earlier occurrence of "
        "the context's last n tokens (no weights, exact as a point mass); hybrid, prompt lookup where the context "
        "has a match and the draft model elsewhere; eagle, a hidden-state head (--draft-model DIR with eagle.json) "
        "reading the target's own hidden states (hybrid with such a head: the head where lookup has no match)",
    )
    parser.add_flag(
        "--prompt-lookup-min", default=2, type=int, help="prompt lookup: shortest suffix n-gram that may match"
    )
    parser.add_flag(
        "--prompt-lookup-max", default=5, type=int, help="prompt lookup: longest suffix n-gram tried (first)"
    )
    parser.add_flag("--max-speculative-tokens", default=8, type=int, help="largest K a request may ask for")
    parser.add_flag(
        "--max-draft-candidates",
        default=4,
        type=int,
        help="most candidates per draft node a request may ask for (multi-draft trees; 1 = chains only)",
    )
    parser.add_flag("--max-tree-nodes", default=64, type=int, help="most nodes of one proposal tree (<= 64)")
    parser.add_flag("--default-max-new-tokens", default=64, type=int, help="when a request says 0")
    parser.add_flag("--max-new-tokens-limit", default=4096, type=int, help="largest max_new_tokens a request may ask")
    parser.add_flag("--max-prompt-tokens", default=8192, type=int, help="longest prompt a request may send")
    parser.add_flag("--max-message-bytes", default=None, type=int, help="gRPC message limit (default: derived)")
    parser.add_flag(
        "--torch-threads",
        default=0,
        type=int,
        help="torch's intra-op CPU threads for the whole process, set at start-up (0: the cores this process "
        "may use); model work runs on the node's engine thread, so this is the one OpenMP team",
    )
    parser.add_flag(
        "--peer-token-file",
        default=None,
        type=Path,
        help="shared secret of the prefill->decode hop: the decode node refuses DecodeService calls without it "
        "(UNAUTHENTICATED), the prefill node sends it on every call; the same file on both nodes "
        "(default: none, for a private network only)",
    )
    parser.add_flag("--grace-seconds", default=5.0, type=float, help="drain time on shutdown")
    parser.add_flag("--tls-cert", default=None, type=Path, help="serve TLS with this certificate chain (PEM)")
    parser.add_flag("--tls-key", default=None, type=Path, help="the private key (PEM) of --tls-cert")
    parser.add_flag(
        "--tls-ca", default=None, type=Path, help="mTLS: require client certificates signed by this CA (PEM)"
    )
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def request_limits(args: argparse.Namespace):
    from protos.validation import RequestLimits

    return RequestLimits(max_new_tokens=args.max_new_tokens_limit, max_prompt_tokens=args.max_prompt_tokens)


def node_options(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> dict:
    """The node-config fields that come from the shared flags (`parser` reports bad ones)."""
    from engine.proposers import check_method
    from models.eagle import is_eagle_dir
    from pdspec.modelspec import ModelSpec
    from pdspec.tls import ServerTls

    try:
        check_method(args.speculative_method, bool(args.draft_model) and is_eagle_dir(args.draft_model))
        tls = ServerTls.from_args(args.tls_cert, args.tls_key, args.tls_ca)
        models = ModelSpec(
            corpus=args.corpus,
            target_model=args.target_model or None,  # "" (an empty env variable) = the built-in pair
            draft_model=args.draft_model or None,
            draft_layers=args.draft_layers,
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            attention_backend=args.attention_backend,
            graph_capture_batch=args.graph_capture_batch,
            graph_capture_context=args.graph_capture_context,
            graph_capture_k=args.graph_capture_k,
        )
    except ValueError as err:
        if parser is None:
            raise
        parser.error(str(err))

    return {
        "host": args.host,
        "port": args.port,
        "metrics_port": None if args.metrics_port < 0 else args.metrics_port,
        "models": models,
        "max_message_bytes": args.max_message_bytes,
        "log_stats_s": args.log_stats_seconds,
        "grace_s": args.grace_seconds,
        "tls": tls,
        "peer_token": read_peer_token(args.peer_token_file, parser),
        "torch_threads": torch_threads(args.torch_threads, parser),
    }


def torch_threads(requested: int, parser: argparse.ArgumentParser | None = None) -> int:
    """--torch-threads resolved: 0 is the number of cores this process may run on."""
    if requested < 0:
        if parser is None:
            raise ValueError(f"--torch-threads: expected 0 or more, got {requested}")
        parser.error(f"--torch-threads: expected 0 or more, got {requested}")
    return requested or len(os.sched_getaffinity(0))


PEER_TOKEN = re.compile(r"[\x21-\x7e]{16,4096}")  # what gRPC metadata carries as it is


def read_peer_token(path: Path | None, parser: argparse.ArgumentParser | None = None) -> str | None:
    """The token in `path` (surrounding whitespace stripped): 16-4096 printable ASCII
    characters without spaces (`openssl rand -hex 32`); None without a path."""
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        problem = f"--peer-token-file: cannot read {path}: {err}"
    else:
        if PEER_TOKEN.fullmatch(token):
            return token
        problem = (
            f"--peer-token-file: expected 16-4096 printable ASCII characters without spaces in {path}, "
            f"got {len(token)} characters"
        )
    if parser is None:
        raise ValueError(problem)
    parser.error(problem)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The one SpeculativeConfig of a node from its flags (ValueError naming the flag when they
    disagree). Request defaults (`--num-speculative-tokens`, `--draft-candidates`) are the prefill
    node's flags and adaptive K (`--adaptive-k`) the decode node's: each takes the flags it has."""
    from engine.spec_config import SpeculativeConfig
    from sampling.proposal import DraftLaw

    own = ("num_speculative_tokens", "draft_candidates", "adaptive_k")
    return SpeculativeConfig(
        method=args.speculative_method,
        max_speculative_tokens=args.max_speculative_tokens,
        draft_law=DraftLaw(args.draft_sampling),
        max_draft_candidates=args.max_draft_candidates,
        max_tree_nodes=args.max_tree_nodes,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        **{name: getattr(args, name) for name in own if hasattr(args, name)},
    )
