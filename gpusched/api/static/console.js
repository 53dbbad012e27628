// gpusched console: the submit form and cancel button call the JSON API (the login cookie
// authenticates them), and a page with data-refresh reloads its live part (#live) when its
// event stream (data-stream) says something happened, or every data-poll ms.
"use strict";

function refresher() {
  const url = document.body.dataset.refresh;
  if (!url) return () => {};
  let pending = null;
  return function refresh() {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      const response = await fetch(url, { credentials: "same-origin" });
      if (response.ok) document.getElementById("live").replaceChildren(...fragment(await response.text()));
    }, 250);
  };
}

// The nodes of a live part the server rendered (jobs_table.html, job_detail.html), never
// assigned as an element's HTML source: Jinja's autoescape made every value in it text, DOMParser
// runs no script, and the page's Content-Security-Policy allows no inline script or event handler
// should markup ever get in.
function fragment(html) {
  return new DOMParser().parseFromString(html, "text/html").body.childNodes;
}

const ENDED = ["succeeded", "failed", "cancelled", "rejected"];

function follow(refresh) {
  const stream = document.body.dataset.stream;
  if (stream) {
    const source = new EventSource(stream);
    // Refresh on every event (each has its type as its name), and again a moment later in case the
    // read models had not caught up yet. A stream ends now and then (its time limit) and the
    // browser reconnects: "open" comes on every connection and catches up on what the gap missed.
    const onEvent = () => {
      refresh();
      setTimeout(refresh, 1500);
      const state = document.getElementById("job-state");  // a job page: stop once the job has ended
      if (state && ENDED.includes(state.textContent.trim())) setTimeout(() => source.close(), 3000);
    };
    source.onmessage = onEvent;
    for (const type of ["open", "JobSubmitted", "JobAdmitted", "JobRejected", "QuotaReserved", "QuotaReleased",
      "QuotaPendingReasonChanged", "SchedulingPendingReasonChanged", "JobScheduled", "JobStarted", "JobSucceeded",
      "JobFailed", "JobPreempted", "JobRetryScheduled", "JobCancelRequested", "JobCancelled", "JobCheckpointed",
      "PreemptionRequested", "ReclaimRequested"]) {
      source.addEventListener(type, onEvent);
    }
  }
  const poll = Number(document.body.dataset.poll || 0);
  if (poll > 0) setInterval(refresh, poll);
}

function describe(problem) {
  const fields = (problem.errors || []).map((e) => `${e.field}: ${e.message}${e.accepted ? ` (accepted: ${e.accepted})` : ""}`);
  return [problem.detail, ...fields].filter(Boolean).join(" — ");
}

async function submitJob(event, refresh) {
  event.preventDefault();
  const form = new FormData(event.target);
  const result = document.getElementById("submit-result");
  const spec = {
    kind: form.get("kind"), queue: form.get("queue"), image: form.get("image"),
    gpus: Number(form.get("gpus")), priority_class: form.get("priority_class") || "training",
    team: form.get("team") || document.body.dataset.team,
  };
  if (form.get("gpu_flavor")) spec.gpu_flavors = [form.get("gpu_flavor")];
  if (form.get("runtime")) spec.expected_runtime_seconds = Number(form.get("runtime"));
  result.textContent = "submitting…";
  result.className = "";
  const response = await fetch("/v1/jobs", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "Idempotency-Key": crypto.randomUUID() },
    body: JSON.stringify({ spec }),
  });
  const body = await response.json();
  if (response.ok) {
    const link = document.createElement("a");
    link.href = `/console/jobs/${encodeURIComponent(body.job_id)}`;
    link.id = "submitted-job";
    link.textContent = body.job_id;
    result.replaceChildren(`${body.decision}: `, link);
  } else {
    result.textContent = `${response.status}: ${describe(body)}`;
    result.className = "error";
  }
  refresh();
}

async function cancelJob(button, refresh) {
  button.disabled = true;
  const response = await fetch(`/v1/jobs/${encodeURIComponent(button.dataset.job)}/cancel`, {
    method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ reason: "cancelled from the console" }),
  });
  if (!response.ok) alert(describe(await response.json()));
  refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  const refresh = refresher();
  follow(refresh);
  const form = document.getElementById("submit-form");
  if (form) form.addEventListener("submit", (event) => submitJob(event, refresh));
  document.addEventListener("click", (event) => {
    if (event.target.matches("button.cancel")) cancelJob(event.target, refresh);
  });
});
