"""An Audit shown inline in Jupyter (`Audit._repr_html_`): the report's first screen, its title, the
run's ending when it failed, the run's time per step and its parts, the median step, the findings
by severity and the costliest findings, with a link to report.html.

The words are the report's (auditor.reports: fmt_ms, cost_text, parts_line, by_cost); every value
from the audit is escaped (jinja2's autoescape).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from auditor.audit import Audit

SHOWN = 10  # the costliest findings listed (the rest are in Audit.findings)
TITLES = {"checkpoint": "Checkpoint audit", "snapshot": "Memory snapshot audit"}

TEMPLATE = """\
<div class="auditor-audit" style="font-family: sans-serif; line-height: 1.4">
<h3 style="margin: 0.2em 0">{{ title }} <code>{{ target }}</code></h3>
{% if failed %}<p style="color: #b00020"><b>The run {{ ending.status }}</b>
{%- if ending.exception %}: {{ ending.exception }}{% if ending.message %}: {{ ending.message }}{% endif %}{% endif %}</p>{% endif %}
<table>
{% if parts %}<tr><th style="text-align: left">Run's time per step</th><td style="text-align: left">{{ parts }}</td></tr>{% endif %}
<tr><th style="text-align: left">Median step</th><td style="text-align: left">{{ median }}</td></tr>
<tr><th style="text-align: left">Findings</th><td style="text-align: left">{{ counts or "none" }}</td></tr>
</table>
{% if shown %}<table>
<tr><th style="text-align: left">severity</th><th style="text-align: left">rule</th><th style="text-align: left">where</th>
<th style="text-align: left">cost</th><th style="text-align: left">message</th></tr>
{% for f in shown %}<tr style="vertical-align: top"><td style="text-align: left">{{ f.severity }}</td>
<td style="text-align: left"><code>{{ f.rule }}</code></td><td style="text-align: left">{{ f.where }}</td>
<td style="text-align: left">{{ f.cost }}</td><td style="text-align: left">{{ f.message }}</td></tr>
{% endfor %}</table>{% if more %}<p>... and {{ more }} more (<code>.findings</code> lists them all)</p>{% endif %}{% endif %}
<p>report: <a href="{{ report_uri }}" target="_blank">{{ report }}</a></p>
</div>
"""


def first_screen(audit: Audit) -> str:
    """The HTML of `audit`'s first screen (the module docstring)."""
    import jinja2

    from auditor.reports.html import cost_text, fmt_ms
    from auditor.reports.run_time_lines import parts_line
    from auditor.reports.terminal import by_cost

    doc = audit.document
    ending = doc.get("ending") or {}
    account = audit.run_time
    findings = audit.finding_records
    counts = ", ".join(f"{n} {s}" for s in ("error", "warning", "info")
                       if (n := sum(f.severity == s for f in findings)))
    shown = [{"severity": f.severity, "rule": f.rule, "cost": cost_text(f), "message": f.message,
              "where": f"{f.locations[0].file}:{f.locations[0].line}" if f.locations else ""}
             for f in by_cost(findings)[:SHOWN]]
    env = jinja2.Environment(autoescape=True)
    return env.from_string(TEMPLATE).render(
        title=TITLES.get(audit.source, "Training-step audit"), target=audit.target,
        failed=audit.source == "run" and ending.get("status", "completed") not in ("completed", "exited"),
        ending=ending, parts=parts_line(account).removeprefix("run's time: ") if account is not None else "",
        median=fmt_ms((doc.get("steps") or {}).get("median_ms")), counts=counts, shown=shown,
        more=max(0, len(findings) - SHOWN), report=audit.report, report_uri=audit.report.as_uri())

