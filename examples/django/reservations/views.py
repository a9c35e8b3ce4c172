"""POST /reservations/<ref>/confirm."""

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from .services import confirm


@csrf_exempt
@require_POST
def confirm_view(request: HttpRequest, ref: str) -> JsonResponse:
    try:
        reservation = confirm(ref)
    except ValueError as exc:
        return JsonResponse({"error": str(exc)}, status=409)
    return JsonResponse({"ref": reservation.ref, "status": reservation.status})
