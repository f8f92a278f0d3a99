// torpor console: live counts over Server-Sent Events, and a confirm before each action.
// No framework and no build step: this file is served as written.
"use strict";

(function () {
  const base = document.body.dataset.base || "/console";

  // `torpor console` prints a login link with the key in the fragment (#key=...): a
  // fragment never reaches the server or its access log. Take it, drop it from the
  // address bar and history, and sign in with the form as a person would.
  const keyField = document.querySelector("form[action$='/login'] input[name=key]");
  if (keyField && window.location.hash.startsWith("#key=")) {
    const key = decodeURIComponent(window.location.hash.slice(5));
    window.history.replaceState(null, "", window.location.pathname + window.location.search);
    if (key) {
      keyField.value = key;
      keyField.form.submit();
      return;
    }
  }

  // Every action form asks first; the reason field is required by the form itself.
  document.querySelectorAll("form[data-confirm]").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      if (form.dataset.confirmed === "1") return;
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });

  const counters = document.querySelectorAll("[data-count]");
  const stateEl = document.querySelector("[data-live-state]");
  if (!counters.length && !stateEl) return;
  const url = new URL(base + "/live", window.location.origin);
  if (stateEl) url.searchParams.set("session", stateEl.dataset.liveState);

  const source = new EventSource(url.toString());
  source.addEventListener("counts", function (event) {
    let data;
    try {
      data = JSON.parse(event.data);
    } catch (err) {
      return;
    }
    counters.forEach(function (el) {
      const n = data.counts && data.counts[el.dataset.count];
      if (typeof n === "number" && String(n) !== el.textContent) {
        el.textContent = String(n);
        el.classList.add("changed");
        window.setTimeout(function () { el.classList.remove("changed"); }, 800);
      }
    });
    if (stateEl && data.session && data.session.state) {
      if (stateEl.textContent !== data.session.state) {
        stateEl.textContent = data.session.state;
        stateEl.className = "state s-" + data.session.state;
      }
    }
    document.body.dataset.live = "1";
  });
  source.addEventListener("error", function () {
    document.body.dataset.live = "0";  // EventSource reconnects by itself
  });
})();
