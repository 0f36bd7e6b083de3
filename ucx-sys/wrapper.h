#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>
