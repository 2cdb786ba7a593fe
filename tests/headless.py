"""Headless Chromium driven over the DevTools protocol (a page's websocket): evaluate JavaScript in
real time and take a screenshot. Debian's `chromium`; `websockets` comes with vLLM's server."""

import asyncio
import base64
import contextlib
import json
import re
import subprocess
import time
import urllib.request


@contextlib.contextmanager
def browser(url: str, profile_dir, width: int = 1100, height: int = 900):
    proc = subprocess.Popen(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile_dir}",
         f"--window-size={width},{height}", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = _devtools_port(proc)
        yield Page(_page_socket(port, url))
    finally:
        proc.kill()
        proc.wait(10)


def _devtools_port(proc, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
        if m:
            return int(m.group(1))
    raise TimeoutError("chromium did not open its DevTools port")


def _page_socket(port: int, url: str) -> str:
    for _ in range(100):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
            pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.1)
    raise TimeoutError(f"no page for {url}")


class Page:
    def __init__(self, ws_url: str):
        self.ws_url = ws_url
        self.next_id = 0

    def call(self, method: str, **params):
        return asyncio.run(self._call(method, params))

    async def _call(self, method, params):
        import websockets

        async with websockets.connect(self.ws_url, max_size=64 * 2**20) as ws:
            self.next_id += 1
            await ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
            while True:
                answer = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if answer.get("id") == self.next_id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
