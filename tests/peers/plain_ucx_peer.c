/*
 * A plain UCX program, no ucxkit in it: the peer of tests/plain_ucx.rs, which checks
 * that ucxkit's tagged messages, active messages, remote keys in UCX's own form and byte
 * streams are UCX's wire format, as any UCX application speaks it.
 *
 *   plain_ucx_peer listen  none|peer          listens on 127.0.0.1, prints "port N"
 *   plain_ucx_peer connect none|peer IP PORT  connects to a UCX listener there
 *   plain_ucx_peer address none|peer          prints "address HEX" (its worker's address,
 *                                             as ucp_worker_get_address gives it), reads
 *                                             the peer's the same way from standard
 *                                             input, and connects to it
 *
 * With its one connection it then serves, phase after phase:
 *   1. tags: each message (any tag) goes back with the tag's top bit set, until one
 *      tagged TAG_END_TAGS;
 *   2. active messages: each of id AM_ECHO goes back as AM_ECHO_BACK with the same
 *      header and payload (a rendezvous payload fetched first), until the header "end";
 *   3. remote memory: sends its own region's key (TAG_MY_KEY: address, length, the
 *      bytes of ucp_rkey_pack), receives what the region should now hold (TAG_EXPECT)
 *      and answers "same" or "differs" (TAG_VERDICT); then receives the peer's key
 *      (TAG_YOUR_KEY, same layout), puts the pattern (i * 7 + 3) & 0xff over that
 *      region, flushes, and says "done" (TAG_PUT_DONE);
 *   4. stream: reads an 8-byte length and that many bytes, and writes them back, until
 *      a length of 0;
 *   5. says "bye" (TAG_BYE), so that the other side knows everything it sent was read
 *      before it closes: a disconnect can overtake data still in flight on another lane,
 *      and UCX drops stream bytes that arrive for an endpoint whose peer disconnected;
 * then closes the connection (flushing) and exits 0. From the bye on, the other side may
 * close at the same time, so a failure of the connection or of the close is expected
 * and ignored. Any other failure prints to stderr and exits non-zero. Numbers on the
 * wire are in this host's byte order.
 */
#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define REPLY_BIT (1ULL << 63)
#define TAG_END_TAGS 0x7ffffffffffffff0ULL
#define TAG_MY_KEY 0x7ffffffffffffff1ULL
#define TAG_EXPECT 0x7ffffffffffffff2ULL
#define TAG_VERDICT 0x7ffffffffffffff3ULL
#define TAG_YOUR_KEY 0x7ffffffffffffff4ULL
#define TAG_PUT_DONE 0x7ffffffffffffff5ULL
#define TAG_BYE 0x7ffffffffffffff6ULL
#define AM_ECHO 7
#define AM_ECHO_BACK 8
#define REGION_LEN (64 * 1024)
#define QUEUE_LEN 16

static ucp_context_h context;
static ucp_worker_h worker;
static ucp_ep_h ep;
static ucp_conn_request_h conn_request;
/* Set once the protocol is served: the other side may close from then on. */
static int served;

/* Active messages the handler took, waiting to be echoed. */
struct am_msg {
    void *header;
    size_t header_len;
    void *data; /* a copy, or UCX's descriptor when rndv */
    size_t len;
    int rndv;
};
static struct am_msg queue[QUEUE_LEN];
static unsigned queued_head, queued_tail;

static void fail(const char *what, ucs_status_t status)
{
    fprintf(stderr, "plain_ucx_peer: %s: %s\n", what, ucs_status_string(status));
    exit(2);
}

static void fail_msg(const char *what)
{
    fprintf(stderr, "plain_ucx_peer: %s\n", what);
    exit(2);
}

static void *xmalloc(size_t len)
{
    void *p = malloc(len ? len : 1);
    if (p == NULL) {
        fail_msg("out of memory");
    }
    return p;
}

static void on_conn_request(ucp_conn_request_h request, void *arg)
{
    (void)arg;
    if (conn_request != NULL) {
        ucp_listener_reject(NULL, request);
        return;
    }
    conn_request = request;
}

static void on_ep_error(void *arg, ucp_ep_h failed, ucs_status_t status)
{
    (void)arg;
    (void)failed;
    if (!served) {
        fail("the connection failed", status);
    }
}

/* Progresses until the request of a *_nbx call is done; NULL means done at once. */
static void wait_for(void *request, const char *what)
{
    ucs_status_t status;

    if (request == NULL) {
        return;
    }
    if (UCS_PTR_IS_ERR(request)) {
        fail(what, UCS_PTR_STATUS(request));
    }
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
    }
    ucp_request_free(request);
    if (status != UCS_OK) {
        fail(what, status);
    }
}

static void tag_send(uint64_t tag, const void *buf, size_t len)
{
    ucp_request_param_t param = {0};
    wait_for(ucp_tag_send_nbx(ep, buf, len, tag, &param), "tag send");
}

/* Receives the message tagged exactly `tag` into a new buffer of its length. */
static void *tag_recv_exact(uint64_t tag, size_t *len)
{
    ucp_request_param_t param = {0};
    ucp_tag_recv_info_t info;
    ucp_tag_message_h msg;
    void *buf;

    while ((msg = ucp_tag_probe_nb(worker, tag, ~0ULL, 1, &info)) == NULL) {
        ucp_worker_progress(worker);
    }
    buf = xmalloc(info.length);
    wait_for(ucp_tag_msg_recv_nbx(worker, buf, info.length, msg, &param), "tag receive");
    *len = info.length;
    return buf;
}

static void serve_tags(void)
{
    ucp_request_param_t param = {0};
    ucp_tag_recv_info_t info;
    ucp_tag_message_h msg;
    void *buf;

    for (;;) {
        while ((msg = ucp_tag_probe_nb(worker, 0, 0, 1, &info)) == NULL) {
            ucp_worker_progress(worker);
        }
        buf = xmalloc(info.length);
        wait_for(ucp_tag_msg_recv_nbx(worker, buf, info.length, msg, &param), "tag receive");
        if (info.sender_tag == TAG_END_TAGS) {
            free(buf);
            return;
        }
        tag_send(info.sender_tag | REPLY_BIT, buf, info.length);
        free(buf);
    }
}

static ucs_status_t on_am(void *arg, const void *header, size_t header_len, void *data,
                          size_t len, const ucp_am_recv_param_t *param)
{
    struct am_msg *m;

    (void)arg;
    if (queued_tail - queued_head == QUEUE_LEN) {
        fail_msg("too many active messages at once");
    }
    m             = &queue[queued_tail++ % QUEUE_LEN];
    m->header     = xmalloc(header_len);
    m->header_len = header_len;
    memcpy(m->header, header, header_len);
    m->len  = len;
    m->rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (m->rndv) {
        /* UCX's descriptor: the payload is fetched outside the handler. */
        m->data = data;
        return UCS_INPROGRESS;
    }
    m->data = xmalloc(len);
    memcpy(m->data, data, len);
    return UCS_OK;
}

/* Set before connecting: a message that comes before its handler is dropped. */
static void set_am_handler(void)
{
    ucp_am_handler_param_t handler = {0};
    ucs_status_t status;

    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    handler.id    = AM_ECHO;
    handler.cb    = on_am;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    status        = ucp_worker_set_am_recv_handler(worker, &handler);
    if (status != UCS_OK) {
        fail("setting the active-message handler", status);
    }
}

static void serve_am(void)
{
    ucp_request_param_t param = {0};
    struct am_msg m;
    void *payload;
    int done = 0;

    while (!done) {
        while (queued_head == queued_tail) {
            ucp_worker_progress(worker);
        }
        m = queue[queued_head++ % QUEUE_LEN];
        if (m.rndv) {
            payload = xmalloc(m.len);
            wait_for(ucp_am_recv_data_nbx(worker, m.data, payload, m.len, &param),
                     "rendezvous payload fetch");
        } else {
            payload = m.data;
        }
        if ((m.header_len == 3) && (memcmp(m.header, "end", 3) == 0)) {
            done = 1;
        } else {
            wait_for(ucp_am_send_nbx(ep, AM_ECHO_BACK, m.header, m.header_len, payload, m.len,
                                     &param),
                     "active message send");
        }
        free(payload);
        free(m.header);
    }
}

/* A key message: address, length, then the bytes of ucp_rkey_pack. */
static void send_key(ucp_mem_h memh, uint64_t addr, uint64_t len)
{
    void *rkey;
    size_t rkey_len;
    char *msg;
    ucs_status_t status;

    status = ucp_rkey_pack(context, memh, &rkey, &rkey_len);
    if (status != UCS_OK) {
        fail("ucp_rkey_pack", status);
    }
    msg = xmalloc(16 + rkey_len);
    memcpy(msg, &addr, 8);
    memcpy(msg + 8, &len, 8);
    memcpy(msg + 16, rkey, rkey_len);
    ucp_rkey_buffer_release(rkey);
    tag_send(TAG_MY_KEY, msg, 16 + rkey_len);
    free(msg);
}

static void serve_rma(void)
{
    ucp_mem_map_params_t map = {0};
    ucp_mem_attr_t attr;
    ucp_request_param_t param = {0};
    ucp_mem_h memh;
    ucp_rkey_h rkey;
    ucs_status_t status;
    uint64_t addr, len, i;
    size_t got;
    char *expect, *key, *pattern;
    const char *verdict;

    /* 1. Our region, reached by the peer through our key. */
    map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                     UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    map.address = NULL;
    map.length  = REGION_LEN;
    map.flags   = UCP_MEM_MAP_ALLOCATE;
    status      = ucp_mem_map(context, &map, &memh);
    if (status != UCS_OK) {
        fail("ucp_mem_map", status);
    }
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    status          = ucp_mem_query(memh, &attr);
    if (status != UCS_OK) {
        fail("ucp_mem_query", status);
    }
    memset(attr.address, 0, REGION_LEN);
    send_key(memh, (uint64_t)(uintptr_t)attr.address, REGION_LEN);
    expect  = tag_recv_exact(TAG_EXPECT, &got);
    verdict = ((got == REGION_LEN) && (memcmp(expect, attr.address, REGION_LEN) == 0)) ?
                      "same" :
                      "differs";
    free(expect);
    tag_send(TAG_VERDICT, verdict, strlen(verdict));
    ucp_mem_unmap(context, memh);

    /* 2. The peer's region, through its key. */
    key = tag_recv_exact(TAG_YOUR_KEY, &got);
    if (got < 16) {
        fail_msg("short key message");
    }
    memcpy(&addr, key, 8);
    memcpy(&len, key + 8, 8);
    status = ucp_ep_rkey_unpack(ep, key + 16, &rkey);
    if (status != UCS_OK) {
        fail("ucp_ep_rkey_unpack", status);
    }
    free(key);
    pattern = xmalloc(len);
    for (i = 0; i < len; i++) {
        pattern[i] = (char)((i * 7 + 3) & 0xff);
    }
    wait_for(ucp_put_nbx(ep, pattern, len, addr, rkey, &param), "put");
    wait_for(ucp_ep_flush_nbx(ep, &param), "flush");
    ucp_rkey_destroy(rkey);
    free(pattern);
    tag_send(TAG_PUT_DONE, "done", 4);
}

static void stream_recv(void *buf, size_t len)
{
    ucp_request_param_t param = {0};
    size_t got;

    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags        = UCP_STREAM_RECV_FLAG_WAITALL;
    wait_for(ucp_stream_recv_nbx(ep, buf, len, &got, &param), "stream receive");
}

static void serve_stream(void)
{
    ucp_request_param_t param = {0};
    uint64_t len;
    void *buf;

    for (;;) {
        stream_recv(&len, sizeof(len));
        if (len == 0) {
            return;
        }
        buf = xmalloc(len);
        stream_recv(buf, len);
        wait_for(ucp_stream_send_nbx(ep, buf, len, &param), "stream send");
        free(buf);
    }
}

/* Closes the endpoint (flushing); the outcome does not matter once the protocol is
 * served: the other side may have closed first. */
static void close_ep(void)
{
    ucp_request_param_t param = {0};
    void *request             = ucp_ep_close_nbx(ep, &param);

    if ((request == NULL) || UCS_PTR_IS_ERR(request)) {
        return;
    }
    while (ucp_request_check_status(request) == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
    }
    ucp_request_free(request);
}

/* Prints this worker's address in hex, then reads the peer's (one line of hex) from
 * standard input into a new buffer. */
static void *exchange_addresses(void)
{
    ucp_address_t *mine;
    size_t len, i, n = 0;
    unsigned byte;
    char line[16384];
    unsigned char *theirs;
    ucs_status_t status;

    status = ucp_worker_get_address(worker, &mine, &len);
    if (status != UCS_OK) {
        fail("ucp_worker_get_address", status);
    }
    printf("address ");
    for (i = 0; i < len; i++) {
        printf("%02x", ((unsigned char*)mine)[i]);
    }
    printf("\n");
    fflush(stdout);
    ucp_worker_release_address(worker, mine);
    if (fgets(line, sizeof(line), stdin) == NULL) {
        fail_msg("no peer address on standard input");
    }
    theirs = xmalloc(sizeof(line) / 2);
    while (sscanf(line + 2 * n, "%2x", &byte) == 1) {
        theirs[n++] = (unsigned char)byte;
    }
    if (n == 0) {
        fail_msg("empty peer address");
    }
    return theirs;
}

int main(int argc, char **argv)
{
    ucp_params_t params               = {0};
    ucp_worker_params_t worker_params = {0};
    ucp_ep_params_t ep_params         = {0};
    ucp_listener_params_t listen_params = {0};
    ucp_listener_attr_t listener_attr;
    ucp_listener_h listener = NULL;
    struct sockaddr_in sa = {0};
    ucp_config_t *config;
    ucs_status_t status;
    int listen_mode, address_mode, peer_mode;
    void *peer_address = NULL;

    if ((argc < 3) ||
        ((strcmp(argv[1], "connect") == 0) ? (argc != 5) :
                                             ((argc != 3) || ((strcmp(argv[1], "listen") != 0) &&
                                                              (strcmp(argv[1], "address") != 0))))) {
        fprintf(stderr, "usage: %s listen none|peer | address none|peer | connect none|peer IP PORT\n",
                argv[0]);
        return 1;
    }
    /* Gone in two minutes whatever happens, even when the test that started it was
     * killed. */
    alarm(120);
    listen_mode  = strcmp(argv[1], "listen") == 0;
    address_mode = strcmp(argv[1], "address") == 0;
    peer_mode   = strcmp(argv[2], "peer") == 0;

    status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) {
        fail("ucp_config_read", status);
    }
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features   = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_AMO64 |
                        UCP_FEATURE_STREAM;
    status            = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (status != UCS_OK) {
        fail("ucp_init", status);
    }
    worker_params.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
    status                    = ucp_worker_create(context, &worker_params, &worker);
    if (status != UCS_OK) {
        fail("ucp_worker_create", status);
    }

    set_am_handler();

    sa.sin_family = AF_INET;
    ep_params.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.err_mode   = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_mode) {
        ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep_params.err_handler.cb = on_ep_error;
    }
    if (address_mode) {
        peer_address          = exchange_addresses();
        ep_params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        ep_params.address     = peer_address;
    } else if (listen_mode) {
        sa.sin_addr.s_addr              = htonl(INADDR_LOOPBACK);
        listen_params.field_mask        = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                                          UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
        listen_params.sockaddr.addr     = (const struct sockaddr*)&sa;
        listen_params.sockaddr.addrlen  = sizeof(sa);
        listen_params.conn_handler.cb   = on_conn_request;
        status = ucp_listener_create(worker, &listen_params, &listener);
        if (status != UCS_OK) {
            fail("ucp_listener_create", status);
        }
        listener_attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        status                   = ucp_listener_query(listener, &listener_attr);
        if (status != UCS_OK) {
            fail("ucp_listener_query", status);
        }
        printf("port %u\n", ntohs(((struct sockaddr_in*)&listener_attr.sockaddr)->sin_port));
        fflush(stdout);
        while (conn_request == NULL) {
            ucp_worker_progress(worker);
        }
        ep_params.field_mask  |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
        ep_params.conn_request = conn_request;
    } else {
        if (inet_pton(AF_INET, argv[3], &sa.sin_addr) != 1) {
            fail_msg("bad IPv4 address");
        }
        sa.sin_port              = htons((uint16_t)atoi(argv[4]));
        ep_params.field_mask    |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
        ep_params.flags          = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        ep_params.sockaddr.addr    = (const struct sockaddr*)&sa;
        ep_params.sockaddr.addrlen = sizeof(sa);
    }
    status = ucp_ep_create(worker, &ep_params, &ep);
    if (status != UCS_OK) {
        fail("ucp_ep_create", status);
    }
    free(peer_address);

    serve_tags();
    serve_am();
    serve_rma();
    serve_stream();

    served = 1;
    tag_send(TAG_BYE, "bye", 3);
    close_ep();
    if (listener != NULL) {
        ucp_listener_destroy(listener);
    }
    ucp_worker_destroy(worker);
    ucp_cleanup(context);
    return 0;
}
