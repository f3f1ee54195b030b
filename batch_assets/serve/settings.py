"""What `batch-assets serve` is started with: the key's variable, the tasks, the upload limits, the address."""

from __future__ import annotations

import errno
import ipaddress
from dataclasses import dataclass

# The bearer key clients must send (their OpenAI API key); required when bound beyond this machine.
SERVE_KEY_ENV = "BATCH_ASSETS_SERVE_API_KEY"
# Which shipped task answers a batch, by its endpoint: chat and completions lines, or embeddings lines.
CHAT_TASK = "openai_batch"
EMBEDDINGS_TASK = "openai_batch_embeddings"
# The Host names a keyless server answers (any port; an IPv6 address in brackets): this machine's own.
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1"]


# How long a file is kept unless its upload (`expires_after`) or its batch (`output_expires_after`)
# says otherwise (`--file-expiry-days`): OpenAI's 30 days for batch files.
DEFAULT_EXPIRY_SECONDS = 30 * 86_400
# A write that failed for want of room: a full disk, a quota, a file size limit. Such a failure
# passes once room is made (the runner tries again); any other does not.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# The bytes of all files kept (`--max-stored-mb`): fifty files of OpenAI's largest size.
DEFAULT_MAX_STORED_MB = 10_000


@dataclass(frozen=True)
class UploadLimits:
    max_bytes: int  # the largest file accepted (`--max-file-mb`)
    max_requests: int  # the most lines a batch file may have (`--max-requests`)
    max_stored_bytes: int = DEFAULT_MAX_STORED_MB * 1024 * 1024  # all files kept, this one with them


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
