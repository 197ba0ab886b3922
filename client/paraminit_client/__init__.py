"""paraminit client: plans in, parameter tensors out."""

from paraminit_client.client import Client, ValidationReport
from paraminit_client.errors import ParaminitError, Violation
from paraminit_client.plans import load_plan, param, plan_from_dict, plan_from_safetensors, plan_of, zip_plan

__all__ = ["Client", "ParaminitError", "ValidationReport", "Violation", "load_plan", "param", "plan_from_dict",
           "plan_from_safetensors", "plan_of", "zip_plan"]
