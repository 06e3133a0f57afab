"""The API's OpenAPI 3.1 document (``GET /v1/openapi.json``): every route, parameter,
body and answer the application serves (``chandrad.api.app``)."""

from __future__ import annotations

from typing import Any

from chandrad.config import Config


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _job_answer(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}}


ERRORS = {"401": _error("no valid bearer token"), "404": _error("no such job (or not yours)")}
JOB_ID = {"name": "job_id", "in": "path", "required": True,
          "schema": {"type": "integer", "minimum": 0}}


def document(config: Config) -> dict[str, Any]:
    formats = list(config.ocr.formats)
    state = {"type": "string", "enum": ["pending", "running", "held", "done", "partial",
                                        "failed", "cancelled"]}
    job: dict[str, Any] = {
        "type": "object",
        "required": ["id", "state", "queue_position"],
        "properties": {
            "id": {"type": "integer"},
            "state": state,
            "file": {"type": "string"}, "size": {"type": "integer"},
            "sha256": {"type": "string"}, "owner": {"type": ["string", "null"]},
            "queue_position": {"type": ["integer", "null"],
                               "description": "pending jobs that start before this one"},
            "pages_total": {"type": ["integer", "null"]}, "pages_done": {"type": "integer"},
            "pages_failed": {"type": "integer"},
            "error": {"type": ["object", "null"]},
            "created_at": {"type": "number"}, "finished_at": {"type": ["number", "null"]},
            "outputs": {"type": "array", "items": {"type": "string"}},
            "results": {"type": "object"},
            "callback_url": {"type": ["string", "null"]},
        },
    }
    upload_fields = {
        "outputs": {"type": "string", "description": f"comma-separated, among {formats}"},
        "callback_url": {"type": "string", "description": "http(s) URL of the webhook"},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "chandrad job API", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Job": job,
                "Error": {"type": "object", "required": ["error"], "properties": {
                    "error": {"type": "object", "required": ["code", "message"],
                              "properties": {"code": {"type": "string"},
                                             "message": {"type": "string"}}}}},
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/jobs": {
                "post": {
                    "summary": "Upload a document as a job",
                    "parameters": [
                        {"name": "filename", "in": "query", "schema": {"type": "string"},
                         "description": "the name of a raw (non-multipart) upload"},
                        *({"name": k, "in": "query", "schema": v}
                          for k, v in upload_fields.items()),
                    ],
                    "requestBody": {"required": True, "content": {
                        "multipart/form-data": {"schema": {
                            "type": "object", "required": ["file"],
                            "properties": {"file": {"type": "string", "format": "binary"},
                                           **upload_fields}}},
                        "application/octet-stream": {"schema": {"type": "string",
                                                                "format": "binary"}},
                    }},
                    "responses": {
                        "202": _job_answer("accepted"),
                        "400": _error("malformed body"), "401": ERRORS["401"],
                        "409": _error("duplicate content (api.duplicates = skip)"),
                        "411": _error("no Content-Length"),
                        "413": _error("over api.max_upload"),
                        "415": _error("a kind of file the pipeline refuses"),
                        "422": _error("bad field"), "503": _error("not accepting now"),
                        "507": _error("the store's filesystem is full"),
                    },
                },
                "get": {
                    "summary": "List jobs (a token's own; an admin token's: all)",
                    "parameters": [
                        {"name": "state", "in": "query", "schema": state},
                        {"name": "limit", "in": "query",
                         "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                    ],
                    "responses": {
                        "200": {"description": "jobs, newest first", "content": {
                            "application/json": {"schema": {
                                "type": "object", "properties": {"jobs": {
                                    "type": "array",
                                    "items": {"$ref": "#/components/schemas/Job"}}}}}}},
                        "401": ERRORS["401"], "422": _error("bad parameter"),
                    },
                },
            },
            "/v1/jobs/{job_id}": {
                "get": {"summary": "A job", "parameters": [JOB_ID],
                        "responses": {"200": _job_answer("the job"), **ERRORS}},
                "delete": {"summary": "Cancel a job", "parameters": [JOB_ID],
                           "responses": {"200": _job_answer("cancelled"), **ERRORS,
                                         "409": _error("already finished"),
                                         "503": _error("stopping")}},
            },
            "/v1/jobs/{job_id}/result": {
                "get": {
                    "summary": "An output of a finished job",
                    "parameters": [JOB_ID, {"name": "format", "in": "query", "schema": {
                        "type": "string",
                        "enum": [*formats, "metadata", "input"]}}],
                    "responses": {"200": {"description": "the file"}, **ERRORS,
                                  "409": _error("not finished"),
                                  "422": _error("format not served for this job")},
                },
            },
            "/v1/jobs/{job_id}/files/{name}": {
                "get": {
                    "summary": "A file of the job's output folder (image crops)",
                    "parameters": [JOB_ID, {"name": "name", "in": "path", "required": True,
                                            "schema": {"type": "string"}}],
                    "responses": {"200": {"description": "the file"}, **ERRORS},
                },
            },
            "/v1/openapi.json": {
                "get": {"summary": "This document", "security": [],
                        "responses": {"200": {"description": "OpenAPI 3.1"}}},
            },
        },
    }
