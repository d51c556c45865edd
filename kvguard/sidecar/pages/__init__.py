"""The sidecar's two web pages: the status page (``GET /``) and the queue lab (``GET /lab``).

Plain HTML, CSS and JavaScript shipped as package data and served by the
sidecar itself (``/static/<name>``): nothing is fetched from a CDN, so the
pages work on machines without internet. The status page reads the same JSON
API as any script (``/v1/report``, ``/v1/checkpoints``); the lab computes
everything in the browser.
"""
