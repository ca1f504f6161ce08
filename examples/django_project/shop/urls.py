from django.urls import path
from ledger import views

urlpatterns = [
    path("accounts/<str:account>", views.account),
    path("accounts/<str:account>/deposit", views.deposit),
    path("invoices/<str:series>", views.invoice),
]
