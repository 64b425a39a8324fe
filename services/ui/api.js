// The gateway's REST API as the viewer uses it. The bearer token lives in sessionStorage (this tab only) and
// travels as an Authorization header, never in a URL.
const TOKEN_KEY = "sisrl.gateway.token";

export class AuthNeeded extends Error {}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export async function health() {
  const resp = await fetch("/health");
  if (!resp.ok) throw new Error(`GET /health: HTTP ${resp.status}`);
  return resp.json();
}

// GET `path` with the query `params` (null, undefined and "" are left out); JSON back, or an Error naming the
// route and the gateway's detail. A 401 forgets the token and raises AuthNeeded.
export async function get(path, params = {}) {
  const url = new URL(path, window.location.origin);
  for (const [key, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") url.searchParams.set(key, String(value));
  }
  const headers = { Accept: "application/json" };
  const bearer = token();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  const resp = await fetch(url, { headers });
  if (resp.status === 401) {
    setToken(null);
    throw new AuthNeeded(bearer ? "the gateway refused this token" : "this gateway needs its API token");
  }
  if (!resp.ok) {
    const text = await resp.text();
    throw new Error(`GET ${url.pathname}: HTTP ${resp.status}: ${text.slice(0, 400)}`);
  }
  return resp.json();
}

export const enc = encodeURIComponent;
