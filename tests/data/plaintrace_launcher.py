"""Record a plain torch.profiler trace of a whole program, no auditor, the way a whole-program
recorder does: `python plaintrace_launcher.py OUT.json prog.py ARGS...` runs prog.py with
`runpy.run_path`, its steps its optimizer steps (`prof.step()` in an optimizer step hook). A loop at
the program's module level is then recorded under a module frame named by its `opt.step()` line."""
import runpy
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

out, target = sys.argv[1], sys.argv[2]
prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True,
               schedule=schedule(wait=2, warmup=1, active=3, repeat=1), on_trace_ready=lambda p: p.export_chrome_trace(out))
register_optimizer_step_post_hook(lambda opt, args, kwargs: prof.step())
prof.start()
sys.argv = [target, *sys.argv[3:]]
runpy.run_path(target, run_name="__main__")
prof.stop()
