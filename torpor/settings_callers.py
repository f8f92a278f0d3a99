"""Who calls torpor, as configuration names them (``torpor.settings``): webhook senders
(sources) with the secrets they sign with, resolved and checked against each other where
they are used; and the API tenants with their keys' hashes."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from torpor.errors import ConfigError, WebhookSecretInvalid
from torpor.ids import not_a_name
from torpor.settings_secrets import resolve_secret
from torpor.settings_sections import _Section
from torpor.webhooks.payloads import PayloadMapping
from torpor.webhooks.signing import Scheme, decode_key, signed_shape


class SourceConfig(_Section):
    """A webhook sender: whose tenant it speaks for, and how it proves who it is."""

    tenant: str = Field(
        description="the tenant this sender speaks for: 1-128 of `[A-Za-z0-9_-.]`,"
        " as tenants are named"
    )
    scheme: Scheme = Field(
        Scheme.TORPOR, description="signature scheme: `torpor`, `standard`, `github`, `stripe`"
    )
    secrets: list[SecretStr] = Field(
        min_length=1, description="every active secret; several during a rotation"
    )
    # Finite and positive: NaN compares false both ways and turned the window off; a day
    # at most, as the replay claims and lookup windows are sized from it.
    tolerance_s: float = Field(
        300.0,
        gt=0,
        le=24 * 3600,
        allow_inf_nan=False,
        description="accepted clock skew of the timestamp, both ways",
    )
    # Positive: 0 or less refused every delivery (413) while the source looked configured.
    max_body_bytes: int = Field(
        256 * 1024, gt=0, description="larger webhook bodies are refused (413); at least 1"
    )
    mapping: PayloadMapping | None = Field(
        None, description="for non-CloudEvents JSON: where id, type, correlation id, … are"
    )
    allowed_origins: list[str] = Field(
        default_factory=list, description="origins allowed by the CloudEvents OPTIONS handshake"
    )
    allowed_rate: int | None = Field(
        None, ge=1, description="`WebHook-Allowed-Rate` in the handshake (`*` if unset)"
    )
    receives_result: bool = Field(
        False, description="late and duplicate answers carry the session's result, not only state"
    )

    @field_validator("tenant")
    @classmethod
    def _tenant_is_a_name(cls, value: str) -> str:
        # As the API's tenants are named (``Settings.tenants``): the tenant names objects
        # in storage, and "" is what the session registry records for a session whose
        # own it does not know (a snapshot whose header did not read).
        if problem := not_a_name("tenant", value):
            raise ValueError(problem)
        return value

    @field_validator("secrets")
    @classmethod
    def _secrets_make_keys(cls, value: list[SecretStr], info: ValidationInfo) -> list[SecretStr]:
        # A secret no delivery could verify with (empty, or not base64 for `standard`)
        # failed every request with a 500. An `env:` one is checked where it is resolved
        # (secret_values): the process that loads the settings may not have the variable.
        scheme = info.data.get("scheme")
        if scheme is None:
            return value  # the scheme itself was refused; that is the error reported
        for index, secret in enumerate(value):
            raw = secret.get_secret_value()
            if not raw.startswith("env:"):
                try:
                    decode_key(scheme, raw, index)
                except WebhookSecretInvalid as exc:
                    raise ValueError(str(exc)) from None
        return value

    def secret_values(self, source: str) -> list[str]:
        """The secrets, resolved now; ``WebhookSecretInvalid`` naming ``source`` (never a
        value) if one is unset or unusable, so the delivery is refused as misconfigured."""
        values = []
        for index, secret in enumerate(self.secrets):
            try:
                value = resolve_secret(secret)
                decode_key(self.scheme, value, index)
            except ConfigError as exc:
                raise WebhookSecretInvalid(f"source {source!r}: {exc}") from None
            values.append(value)
        return values


def verifying_secrets(sources: Mapping[str, SourceConfig], name: str) -> list[str]:
    """The secrets source ``name`` verifies with, resolved now (``secret_values``), and
    checked against the other sources whose schemes sign the same bytes: two that share
    a key accept each other's deliveries. Settings refuse that at load for the secrets
    written inline; an ``env:`` one is only known here, where it resolves. Refused as
    misconfigured (``WebhookSecretInvalid``, naming the sources, never a value)."""
    source = sources[name]
    values = source.secret_values(name)
    shape = signed_shape(source.scheme)
    others = [
        (other, config)
        for other, config in sources.items()
        if other != name and signed_shape(config.scheme) == shape
    ]
    if not any(_from_env(config) for _, config in [(name, source), *others]):
        return values  # all inline: compared when the settings loaded
    mine = {decode_key(source.scheme, value) for value in values}
    for other, config in others:
        for secret in config.secrets:
            try:
                key = decode_key(config.scheme, resolve_secret(secret))
            except (ConfigError, WebhookSecretInvalid):
                continue  # unusable there: refused when that source is used
            if key in mine:
                first, second = sorted((other, name))
                raise WebhookSecretInvalid(
                    f"sources {first!r} and {second!r} share a secret and sign the same bytes "
                    f"({shape}): a delivery to one would be accepted by the other"
                )
    return values


def _from_env(source: SourceConfig) -> bool:
    return any(secret.get_secret_value().startswith("env:") for secret in source.secrets)


class TenantConfig(_Section):
    api_keys: list[str] = Field(
        default_factory=list, description="bearer API keys as `sha256:` hashes (`torpor keys api`)"
    )
