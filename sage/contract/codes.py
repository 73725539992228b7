"""Every error code sage and its capsules answer or raise with: one vocabulary.

A code is the machine-readable reason a :class:`~sage.errors.SageError` carries and a
failure reply names (``{"ok": false, "error": CODE, ...}``, sage/replies.py).  Each
one is a value of :class:`ErrorCode`, spelled once here; docs/topics.md says what each
means.  ``tests/unit/test_error_codes.py`` reads every code the source spells (a
class default, a ``code=`` keyword, a reply) and fails on one that is not here, or
one here that the doc does not name.

Grouped by who answers with them; a code may be answered by several (``bad_request``,
``unknown_session``, ``not_authorized``, ...): it means the same wherever it comes from.
"""

from __future__ import annotations

import enum

__all__ = ("ErrorCode",)


class ErrorCode(enum.StrEnum):
    """One reason a request was refused or an operation failed."""

    # -- any request, any capsule ------------------------------------------------
    ERROR = "error"  # SageError's default: a more precise code was not named
    BAD_REQUEST = "bad_request"
    NOT_AUTHORIZED = "not_authorized"
    UNKNOWN_REQUEST = "unknown_request"
    INTERNAL_ERROR = "internal_error"  # a bug, logged with its traceback
    REPLY_FAILED = "reply_failed"
    TIMEOUT = "timeout"
    ILLEGAL_TRANSITION = "illegal_transition"  # a state machine's table refused a change

    # -- the daemon's parts (sage/errors.py families) ------------------------------
    CONFIG_INVALID = "config_invalid"
    PROTOCOL_ERROR = "protocol_error"
    PROCESS_FAILED = "process_failed"
    AUDIT_FAILED = "audit_failed"
    STATE_FAILED = "state_failed"  # the state store could not be opened, read or written
    UPSTREAM_FAILED = "upstream_failed"
    STREAM_INCOMPLETE = "stream_incomplete"
    ALREADY_RUNNING = "already_running"
    SECRET_STORE_FAILED = "secret_store_failed"
    TOOL_ERROR = "tool_error"

    # -- capsules: the supervisor's capsule requests, the tool bridge, the llm ---------
    ACL_DENIED = "acl_denied"
    BAD_CAPSULE = "bad_capsule"
    BUILTIN = "builtin"
    NAME_TAKEN = "name_taken"
    NOT_INSTALLED = "not_installed"
    REMOVE_FAILED = "remove_failed"
    RUNNING = "running"
    STOP_TIMEOUT = "stop_timeout"
    UNKNOWN_CAPSULE = "unknown_capsule"
    POLICY_INVALID = "policy_invalid"
    UNKNOWN_MODEL = "unknown_model"
    TOO_MANY_REPL_SESSIONS = "too_many_repl_sessions"

    # -- the session runner: spawn, send, stop, wake, adopt, ... -----------------------
    SESSION_ERROR = "session_error"  # SessionError's default: never answered as such
    UNKNOWN_SESSION = "unknown_session"
    INVALID_SESSION_ID = "invalid_session_id"
    DUPLICATE_SESSION = "duplicate_session"
    SESSION_ENDED = "session_ended"
    HIBERNATED = "hibernated"
    NOT_READY = "not_ready"
    PRINCIPAL_LIMIT = "principal_limit"
    HOST_FULL = "host_full"
    SPAWN_FAILED = "spawn_failed"
    PAYLOAD_TOO_LARGE = "payload_too_large"  # a turn over [limits] stdin_quota, or any
    # request over the bus's max_payload (refused by the client before it is sent)
    CONTROL_FAILED = "control_failed"
    INTERACTION_MODE_IS_REPL = "interaction_mode_is_repl"
    BAD_CWD = "bad_cwd"
    CWD_NOT_ALLOWED = "cwd_not_allowed"
    CWD_MISSING = "cwd_missing"
    UNSAFE_CWD = "unsafe_cwd"
    BAD_MODEL = "bad_model"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    CLAUDE_MISSING = "claude_missing"
    CLAUDE_UNSUPPORTED = "claude_unsupported"
    API_KEY_MISSING = "api_key_missing"
    API_KEY_UNREADABLE = "api_key_unreadable"
    UNSAFE_HOME = "unsafe_home"
    HOME_UNREACHABLE = "home_unreachable"
    SESSION_UID_UNAVAILABLE = "session_uid_unavailable"
    UNKNOWN_APPROVAL = "unknown_approval"
    UNKNOWN_SERVER = "unknown_server"  # the CLI's own control requests, never on the bus
    BAD_MESSAGE = "bad_message"  # likewise
    NOT_TAKEN = "not_taken"  # likewise: a warm spare's hook callback
    HOOK_UNDELIVERED = "hook_undelivered"  # astrid-emit: the bus did not take the hook
    BAD_COMMAND_LINE = "bad_command_line"  # astrid-emit: a command line it cannot read
    NO_TERMINAL = "no_terminal"  # astrid: approvals --watch asks at a terminal, stdin is not

    # -- budgets: the usage ledger (sage/usage) -----------------------------------------
    BUDGET_EXCEEDED = "budget_exceeded"  # a spawn, send, wake, generate, REPL or its tool
    # call while the principal is at or past a budget; the message names spend, budget, reset
    BUDGET_UNKNOWN = "budget_unknown"  # the usage ledger did not answer: nothing is admitted

    # -- principals: settings and installs ---------------------------------------------
    UNKNOWN_PRINCIPAL = "unknown_principal"
    INVALID_PRINCIPAL = "invalid_principal"
    SETTINGS_ERROR = "settings_error"
    RULE_NOT_ALLOWED = "rule_not_allowed"  # wider than [limits] self_allow_rules
    SETTINGS_CORRUPT = "settings_corrupt"
    SCHEMA_VERSION_UNSUPPORTED = "schema_version_unsupported"
    INSTALLER_UNAVAILABLE = "installer_unavailable"
    INSTALL_FAILED = "install_failed"
    INSTALL_TIMEOUT = "install_timeout"
    RELINK_FAILED = "relink_failed"

    # -- the fleet ----------------------------------------------------------------------
    FLEET_FAILED = "fleet_failed"
    FLEET_UNREACHABLE = "fleet_unreachable"
    FLEET_AUTH_FAILED = "fleet_auth_failed"
    FLEET_CREDENTIALS_INVALID = "fleet_credentials_invalid"
    FLEET_NO_CREDENTIALS = "fleet_no_credentials"  # [fleet] without credentials nor the flag
    FLEET_TLS_INVALID = "fleet_tls_invalid"
    FLEET_TLS_FAILED = "fleet_tls_failed"
    FLEET_BUCKET_FAILED = "fleet_bucket_failed"
    FLEET_HEARTBEAT_FAILED = "fleet_heartbeat_failed"
    FLEET_RECORD_INVALID = "fleet_record_invalid"
    FLEET_UNAVAILABLE = "fleet_unavailable"  # NATS down, no answer in time, no responders
    FLEET_LEASE_LOST = "fleet_lease_lost"  # the node holds no fleet lease: it starts nothing
    FLEET_RACE_LOST = "fleet_race_lost"  # a key changed since the revision a write named
    FLEET_NOT_FOUND = "fleet_not_found"  # a key, bucket or object is not there
    FLEET_BUSY = "fleet_busy"
    FLEET_STREAM_UNSAFE = "fleet_stream_unsafe"  # a stream allows what the fleet must not
    FLEET_SERVER_UNSUPPORTED = "fleet_server_unsupported"  # a NATS server older than 2.11
    NOT_IN_FLEET = "not_in_fleet"
    NO_RUNNER = "no_runner"
    SESSION_CONFLICT = "session_conflict"
    PRINCIPAL_NOT_AUTHENTICATED = "principal_not_authenticated"
    PLACEMENT_FAILED = "placement_failed"
    TRANSCRIPT_REFUSED = "transcript_refused"
    AUDIT_UNREADABLE = "audit_unreadable"
    BAD_NODE_NAME = "bad_node_name"
    BAD_USER_NAME = "bad_user_name"
    BAD_NKEY = "bad_nkey"

    # -- the completion provider (capsules/llm: its Error events, the Messages API's) ----
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    BUSY = "busy"
    NO_API_KEY = "no_api_key"
    AUTHENTICATION = "authentication"
    PERMISSION = "permission"
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    SERVER_ERROR = "server_error"
    API_ERROR = "api_error"
    CONNECTION = "connection"
    CANCELLED = "cancelled"
    STOPPED = "stopped"

    # -- the forge -------------------------------------------------------------------------
    FORGE_FAILED = "forge_failed"
    SANDBOX_FAILED = "sandbox_failed"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    SANDBOX_UID_UNAVAILABLE = "sandbox_uid_unavailable"
    SANDBOX_UID_TAKEN = "sandbox_uid_taken"
    SANDBOX_UID_EXHAUSTED = "sandbox_uid_exhausted"
    MOUNT_REFUSED = "mount_refused"
    BAD_ARGUMENTS = "bad_arguments"
    BAD_COMMAND = "bad_command"
    BAD_ENV = "bad_env"
    BAD_LIMITS = "bad_limits"
    BAD_NAME = "bad_name"
    BAD_OUTPUT = "bad_output"
    BAD_RUNTIME = "bad_runtime"
    BAD_SCHEMA = "bad_schema"
    BAD_SCOPE = "bad_scope"
    UNKNOWN_TOOL = "unknown_tool"
    UNKNOWN_RUN = "unknown_run"
    STATIC_CHECK_FAILED = "static_check_failed"
    VALIDATION_FAILED = "validation_failed"
    BREAKER_OPEN = "breaker_open"
    ALREADY_PROMOTED = "already_promoted"
    PROMOTE_CONFLICT = "promote_conflict"
    OUTPUT_TRUNCATED = "output_truncated"
    ARTIFACT_WITHHELD = "artifact_withheld"
    NO_ARTIFACT = "no_artifact"
