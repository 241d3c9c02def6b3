// MathJax 3 configuration for pymdownx.arithmatex (generic mode): typeset only the
// spans and blocks arithmatex marks. MathJax itself is served by the site
// (assets/mathjax/, copied by docs/hooks.py): nothing is fetched from the network.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// MathJax typesets the page it is loaded on by itself. Material's instant navigation
// (if enabled) swaps pages without reloading scripts: typeset each new page then. The
// first emission of document$ is the page MathJax is already typesetting; clearing its
// caches then would drop the CSS of the glyphs it is drawing (blank formulas).
if (typeof document$ !== "undefined") {
  let first = true;
  document$.subscribe(() => {
    if (first) {
      first = false;
      return;
    }
    if (window.MathJax && MathJax.typesetPromise) {
      MathJax.startup.output.clearCache();
      MathJax.typesetClear();
      MathJax.texReset();
      MathJax.typesetPromise();
    }
  });
}
