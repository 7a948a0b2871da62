"""`python tests/gcs_server.py PORT BUCKET`: a local Cloud Storage server for the tests of gs:// run directories.

gcp-storage-emulator speaks the JSON API that gcsfs and tensorstore use, less two parts tensorstore relies on:
the object generation on reads (the x-goog-generation header) and generation preconditions (ifGenerationMatch,
ifGenerationNotMatch), through which Orbax's OCDBT store updates its manifests. Without them a save now and then
fails with "Malformed StorageGeneration" or waits forever. This server adds both.
"""

import sys
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _generation(storage, bucket: str, name: str) -> int | None:
    try:
        return int(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return None


def _precondition_failed(request, storage, name: str, read: bool) -> HTTPStatus | None:
    """GCS's answer when the request's generation preconditions do not hold (generation 0: no such object)."""
    current = _generation(storage, request.params["bucket_name"], name)
    if read and current is None:
        return None  # the handler answers 404
    current = current or 0
    match, not_match = request.query.get("ifGenerationMatch"), request.query.get("ifGenerationNotMatch")
    if match and int(match[0]) != current:
        return HTTPStatus.PRECONDITION_FAILED
    if not_match and int(not_match[0]) == current:
        return HTTPStatus.NOT_MODIFIED if read else HTTPStatus.PRECONDITION_FAILED
    return None


def _with_generations(handler, read: bool, name_of):
    def handle(request, response, storage, *args, **kwargs):
        name = name_of(request)
        if name is not None and (status := _precondition_failed(request, storage, name, read)):
            response.status = status
            return None
        result = handler(request, response, storage, *args, **kwargs)
        if read and response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"], name)
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]
        return result

    return handle


def _object_id(request):
    return request.params["object_id"]


def _uploaded_name(request):
    """The object a simple (media) upload writes; other uploads carry no preconditions here."""
    return request.query["name"][0] if request.query.get("uploadType") == ["media"] else None


# Before the server module is imported: its routing table holds these functions, and `get` (alt=media) calls
# the module's `download`.
objects.download = _with_generations(objects.download, read=True, name_of=_object_id)
objects.delete = _with_generations(objects.delete, read=False, name_of=_object_id)
objects.insert = _with_generations(objects.insert, read=False, name_of=_uploaded_name)

from gcp_storage_emulator.__main__ import main  # noqa: E402

if __name__ == "__main__":
    port, bucket = sys.argv[1:]
    main(["start", f"--port={port}", "--in-memory", f"--default-bucket={bucket}"])
