"""JSON views; a busy lock answers 409 Conflict with Retry-After, never a 500."""

from __future__ import annotations

import math

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from lockaspect import LockLost, LockNotAcquired

from . import services
from .models import Account


def _busy(error: LockNotAcquired) -> JsonResponse:
    response = JsonResponse({"error": "busy", "key": error.key}, status=409)
    response["Retry-After"] = str(max(1, math.ceil(error.holder_ttl or 1.0)))
    return response


@require_GET
def account(request: HttpRequest, account: str) -> HttpResponse:
    found = Account.objects.filter(pk=account).first()
    if found is None:
        return JsonResponse({"error": "no such account"}, status=404)
    return JsonResponse({"account": found.name, "balance": found.balance, "fence": found.fence})


@require_POST
def deposit(request: HttpRequest, account: str) -> HttpResponse:
    try:
        amount = int(request.POST["amount"])
    except (KeyError, ValueError):
        return JsonResponse({"error": "amount must be an integer"}, status=400)
    try:
        balance, token = services.deposit(account, amount)
    except LockNotAcquired as busy:
        return _busy(busy)
    except LockLost:
        return JsonResponse({"error": "lock lost, nothing written"}, status=503)
    return JsonResponse({"account": account, "balance": balance, "fencing_token": token})


@require_POST
def invoice(request: HttpRequest, series: str) -> HttpResponse:
    try:
        made = services.issue_invoice(series, int(request.POST.get("amount", "0")))
    except LockNotAcquired as busy:
        return _busy(busy)
    return JsonResponse({"series": made.series, "number": made.number}, status=201)
