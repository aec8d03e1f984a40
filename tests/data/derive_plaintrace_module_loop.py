"""Derive tests/fixtures/h100/derived/plaintrace_module_loop.json.gz from a real H100 recording of
examples/demo.py's step (tests/fixtures/h100/plain/plain_demo.json.gz: `step(i)` called in a plain loop, the
profiler stepped after each call) into the shape a whole-program recorder gives a loop at module
level (plaintrace_module_loop.py, run by `runpy.run_path` with `prof.step()` in an optimizer step
hook): the launcher's frames above the program's module frame, that frame named by the line it was
on when the profiler started (`opt.step()`, whose hook started it), the hook and the optimizer's
step around that first `prof.step()`, the step function's own frames gone (its calls made by the
module code), demo.py's `__getitem__` that file's. Every op, kernel, copy and sync is the
recording's; the memory events are left out (size).

    python tests/data/derive_plaintrace_module_loop.py
"""
import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
H100 = HERE.parent / "fixtures" / "h100"
SOURCE = (HERE / "plaintrace_module_loop.py").read_text().splitlines()


def marked(marker: str) -> int:
    return next(i for i, t in enumerate(SOURCE, 1) if t.endswith(f"# {marker}"))


def derive(recording: Path) -> dict:
    doc = json.load(gzip.open(recording))
    events = [e for e in doc["traceEvents"] if e.get("name") != "[memory]"]
    py = sorted((e for e in events if e.get("cat") == "python_function"), key=lambda e: e["ts"])
    root, first = py[0], py[1]  # the driver's `<string>(8): <module>`, and the prof.step() the profiler started in
    assert root["name"] == "<string>(8): <module>" and first["name"].startswith("torch/profiler/profiler.py"), py[:2]
    steps = {e["args"]["Python id"] for e in py if e["name"].startswith("demo.py(38): step")}
    root_id = root["args"]["Python id"]
    for e in py:
        if e["args"].get("Python parent id") in steps:  # the step function's calls: the module code's
            e["args"]["Python parent id"] = root_id
        if e["name"].startswith("demo.py(22): __getitem__"):
            e["name"] = f"plaintrace_module_loop.py({marked('GETITEM LINE')}): __getitem__"
    events = [e for e in events if not (e.get("cat") == "python_function" and e["args"]["Python id"] in steps)]
    root["name"] = f"plaintrace_module_loop.py({marked('STEP LINE')}): <module>"
    next_id = max(e["args"]["Python id"] for e in py) + 1

    def frame(name: str, around: dict, parent: int | None, pad: float) -> dict:
        nonlocal next_id
        next_id += 1
        return {"ph": "X", "cat": "python_function", "name": name, "pid": around["pid"], "tid": around["tid"],
                "ts": around["ts"] - pad, "dur": around["dur"] + 2 * pad,
                "args": {"Python parent id": parent, "Python id": next_id, "Ev Idx": 0}}

    launcher = [("plaintrace.py(16): <module>", 0.5), ("<frozen runpy>(291): run_path", 0.4),
                ("<frozen runpy>(98): _run_module_code", 0.3), ("<frozen runpy>(88): _run_code", 0.2)]
    parent, added = None, []
    for name, pad in launcher:
        added.append(frame(name, root, parent, pad))
        parent = added[-1]["args"]["Python id"]
    root["args"]["Python parent id"] = parent
    wrapper = frame("torch/optim/optimizer.py(512): wrapper", first, root_id, 0.2)
    hook = frame("plaintrace.py(12): <lambda>", first, wrapper["args"]["Python id"], 0.1)
    first["args"]["Python parent id"] = hook["args"]["Python id"]
    doc["traceEvents"] = [*added, wrapper, hook, *events]
    return doc


if __name__ == "__main__":
    out = H100 / "derived" / "plaintrace_module_loop.json.gz"
    out.parent.mkdir(exist_ok=True)
    with gzip.open(out, "wt") as f:
        json.dump(derive(Path(sys.argv[1]) if len(sys.argv) > 1 else H100 / "plain" / "plain_demo.json.gz"), f)
    print(out, out.stat().st_size)
