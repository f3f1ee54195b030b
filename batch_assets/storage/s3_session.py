"""The HTTP session s3fs's botocore client uses: aiobotocore's, without `Expect: 100-continue`.

botocore asks for `100 Continue` before sending a PUT body; aiohttp then waits for that interim
answer with no timeout at all (no read is in flight for the read timeout to arm against), so an
endpoint that accepts the connection and never answers would hang every write forever. Without the
header the body goes out at once and the wait for the answer is bounded by the read timeout. The
header is not signed (SigV4 leaves `expect` out), so requests stay valid.
"""

from __future__ import annotations

from aiobotocore.httpsession import AIOHTTPSession


class BoundedAIOHTTPSession(AIOHTTPSession):
    async def send(self, request):
        request.headers.pop("Expect", None)
        return await super().send(request)
