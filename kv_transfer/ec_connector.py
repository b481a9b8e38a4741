"""The encoder-cache connector duet's engines load: vLLM's ``ECExampleConnector``, made safe to
share a folder under failures.

vLLM's example connector writes an image's encoder output in place and counts a file as cached
as soon as it exists, and it creates a folder for every image it is merely asked about. An encode
worker killed mid-write would then leave a truncated file that every prefill engine tries to
load (crashing in its model step), and the folder would fill with empty folders for images no
one encoded. This subclass writes each output to a temporary file in the image's folder and
renames it into place (readers see the whole file or none), and asks about an image without
creating anything. The file layout is the example connector's (kv_transfer/encoder_cache.py).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from duet.kv_transfer.encoder_cache import entry_file

# Where vLLM finds this class: ``ec_connector_module_path`` and ``ec_connector`` of an engine's
# ``ec_transfer_config``.
MODULE_PATH = __name__
CONNECTOR_NAME = "DuetFolderECConnector"


class DuetFolderECConnector(ECExampleConnector):
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        """Write the image's output whole, or not at all (a temporary file renamed into place)."""
        if not self.is_producer:
            return
        import safetensors.torch

        target = self._generate_filename_debug(mm_hash)  # creates the image's folder
        staging = f"{target}.{os.getpid()}.partial"
        try:
            safetensors.torch.save_file({"ec_cache": encoder_cache[mm_hash].detach().cpu()}, staging)
            os.replace(staging, target)
        finally:
            if os.path.exists(staging):
                os.remove(staging)

    def _found_match_for_mm_data(self, mm_hash: str) -> bool:
        """Whether the image's output is in the folder, creating nothing."""
        return os.path.exists(entry_file(self._storage_path, mm_hash))
