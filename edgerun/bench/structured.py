"""`edgerun bench schema`: decode tok/s with a JSON schema vs without, on the same prompt.

One runner, two sides in ABBA turns: the reply free, and the reply under a schema whose JSON runs
about as long (an array of records), at each temperature asked. The mask (llama.cpp's grammar,
native/grammar.hpp) is checked on the model's own pick first, then the best 64 candidates, and
on the whole vocabulary only when none of those fits; at T > 0 on the sampler chain's survivors.

Claim: the schema side decodes at >= 0.9x the free side (the mask costs less than a tenth of a step).
"""

from __future__ import annotations

import argparse
import json

from edgerun.bench.scenario import Scenario, claim, count, interleave, register, side_lines
from edgerun.bench.spec import _floats
from edgerun.bench.stats import ratio_spread, spread

PROMPT = ("List the planets of the solar system as JSON: for each its name, its order from the sun, whether it"
          " has rings, its number of known moons and a one-line description.")
SCHEMA = {
    "type": "object",
    "properties": {"planets": {"type": "array", "maxItems": 8, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "order": {"type": "integer", "minimum": 1, "maximum": 8},
                       "rings": {"type": "boolean"},
                       "moons": {"type": "integer", "minimum": 0, "maximum": 200},
                       "description": {"type": "string", "maxLength": 80}},
        "required": ["name", "order", "rings", "moons", "description"]}}},
    "required": ["planets"],
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="qwen2.5-coder-0.5b", help="the model (default qwen2.5-coder-0.5b)")
    p.add_argument("-n", "--max-tokens", type=count, default=128, help="tokens per reply (default 128)")
    p.add_argument("--repeat", type=count, default=4, help="turns per side and temperature (default 4)")
    p.add_argument("--temps", type=_floats, default=[0.0, 0.7], metavar="T[,T...]", help="temperatures (default 0,0.7)")
    p.add_argument("--schema", default=None, metavar="FILE|JSON", help="the schema (default: a list of planets)")
    p.add_argument("--prompt", default=PROMPT, help="the prompt (default: the planets)")
    p.add_argument("--threads", type=count, default=None, help="CPU threads (default: EDGERUN_THREADS, else physical cores)")
    p.add_argument("--gpu-layers", default="auto", help="layers on the GPU: auto, 0 or a count")


def measure(args: argparse.Namespace, say) -> dict:
    from edgerun.decode import constrain
    from edgerun.decode.generate import Step
    from edgerun.decode.stats import ReplyStats
    from edgerun.runner import Runner
    from edgerun.settings import EngineSettings, SamplerSettings

    schema = constrain.schema_arg(args.schema) if args.schema else SCHEMA
    constraint = constrain.json_schema(schema)
    engine = EngineSettings().replace(n_ctx=2048, n_threads=args.threads, gpu_layers=args.gpu_layers)
    rows, sides = [], {}
    with Runner(args.model, engine) as runner:
        tokens = runner.chat_tokens([{"role": "user", "content": args.prompt}])
        for temp in args.temps:
            sampling = SamplerSettings().replace(temperature=temp, seed=0)
            replies: dict[str, list[dict]] = {"free": [], "schema": []}

            def side(name: str, with_schema: bool):
                def one() -> float:
                    stats, text = ReplyStats(), []
                    for record in runner.stream(tokens, sampling, max_tokens=args.max_tokens,
                                                constraint=constraint if with_schema else None):
                        stats.add(record)
                        if isinstance(record, Step):
                            text.append(record.text)
                    replies[name].append({"tokens": stats.generated_tokens, "decode_tok_s": stats.decode_tok_s,
                                          "valid": _valid(schema, "".join(text), stats.finish) if with_schema else None})
                    return stats.decode_tok_s
                return one

            say(f"temperature {temp}")
            values = interleave({"free": side("free", False), "schema": side("schema", True)}, args.repeat, say)
            sides |= {f"{name} T={temp:g}": spread(v) for name, v in values.items()}
            rows.append({"temperature": temp, "ratio": ratio_spread(values["free"], values["schema"]),
                         "free": replies["free"], "schema": replies["schema"]})
    settings = {"model": args.model, "max_tokens": args.max_tokens, "repeat": args.repeat, "temps": args.temps,
                "prompt": args.prompt, "schema": schema, "threads": args.threads, "gpu_layers": args.gpu_layers}
    worst = min((r["ratio"] for r in rows if r["ratio"]), key=lambda r: r["median"], default=None)
    return {"settings": settings, "sides": sides, "rows": rows,
            "claims": [claim("schema / free decode tok/s (worst temperature)", worst, ">= 0.9")]}


def _valid(schema: dict, text: str, finish: str | None) -> bool | None:
    """Whether a finished reply validates (None: cut at the token budget, or no jsonschema here)."""
    if finish != "stop":
        return None
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def report(doc: dict) -> str:
    from edgerun.bench.table import align

    rows = [["T", "ratio (min-max)", "free tokens", "schema tokens", "schema replies valid"]]
    for r in doc["rows"]:
        ratio = r["ratio"]
        valid = [x["valid"] for x in r["schema"] if x["valid"] is not None]
        rows.append([f"{r['temperature']:g}", f"{ratio['median']:.3f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio
                     else "-", "/".join(str(x["tokens"]) for x in r["free"]),
                     "/".join(str(x["tokens"]) for x in r["schema"]), f"{sum(valid)}/{len(valid)} finished"])
    s = doc["settings"]
    head = f"{s['model']}; {s['max_tokens']} tokens, {s['repeat']} turns per side; ratio = schema / free in the same turn"
    return "\n".join([head, *side_lines(doc["sides"]), "", *align(rows)])


register(Scenario("schema", "decode tok/s with a JSON schema vs without on the same prompt (goal >= 0.9)",
                  add_args, measure, report))
