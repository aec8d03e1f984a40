// report.html behaviour: draw the embedded plots, copy buttons. No network: everything is in the page.
(function () {
  "use strict";
  var node = document.getElementById("auditor-data");
  var data = JSON.parse(node.textContent);
  window.auditorReport = data;  // the findings.json document and plot specs, for anyone poking at the page

  if (data.plots.length && typeof Plotly !== "undefined") {
    data.plots.forEach(function (p) {
      var div = document.getElementById(p.id);
      if (!div) { return; }
      var layout = p.figure.layout || {};
      if (!layout.template && data.plot_template) { layout.template = data.plot_template; }
      layout.autosize = true;
      Plotly.newPlot(div, p.figure.data || [], layout,
                     {responsive: true, displaylogo: false, showLink: false, showSendToCloud: false});
    });
  }

  function copyText(text, button) {
    function done() { button.textContent = "Copied"; setTimeout(function () { button.textContent = "Copy"; }, 1500); }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallback(text); done(); });
    } else { fallback(text); done(); }
  }
  function fallback(text) {
    var area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (e) { /* the text stays selectable by hand */ }
    document.body.removeChild(area);
  }
  Array.prototype.forEach.call(document.querySelectorAll("button.copy"), function (b) {
    b.addEventListener("click", function () {
      var pre = document.getElementById(b.getAttribute("data-copy"));
      if (pre) { copyText(pre.textContent, b); }
    });
  });
})();
