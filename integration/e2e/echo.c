/* The lane's test server and client, in the busybox image as /bin/np-echo (busybox's nc has
 * no UDP, and its static wget cannot even parse an address).
 *
 *   np-echo serve PORT...         TCP and UDP on [::]:PORT (IPv4 too); every connection or
 *                                 datagram is answered "<hostname> <client address>".
 *   np-echo ask HOST PORT tcp|udp|connect N
 *                                 N requests, one after another; one line each: the answer,
 *                                 "refused", "timeout" or "error <errno>" ("connect": a TCP
 *                                 connection made is "connected", whatever the server says).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

static char host[256];

static void peer_text(const struct sockaddr_in6 *a, char *out, size_t len) {
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr))
        inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], out, len);
    else
        inet_ntop(AF_INET6, &a->sin6_addr, out, len);
}

static int listener(int type, int port) {
    int s = socket(AF_INET6, type, 0), off = 0, on = 1;
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(port), .sin6_addr = in6addr_any};
    if (s < 0 || setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) ||
        setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) || bind(s, (struct sockaddr *)&a, sizeof a)) {
        perror("np-echo: listen");
        exit(1);
    }
    if (type == SOCK_STREAM && listen(s, 128)) {
        perror("np-echo: listen");
        exit(1);
    }
    return s;
}

static void *serve_tcp(void *arg) {
    int s = listener(SOCK_STREAM, (int)(long)arg);
    for (;;) {
        struct sockaddr_in6 a;
        socklen_t len = sizeof a;
        int c = accept(s, (struct sockaddr *)&a, &len);
        if (c < 0)
            continue;
        char peer[INET6_ADDRSTRLEN], msg[512];
        peer_text(&a, peer, sizeof peer);
        int n = snprintf(msg, sizeof msg, "%s %s\n", host, peer);
        (void)!write(c, msg, n);
        close(c);
    }
    return NULL;
}

static void *serve_udp(void *arg) {
    int s = listener(SOCK_DGRAM, (int)(long)arg);
    for (;;) {
        struct sockaddr_in6 a;
        socklen_t len = sizeof a;
        char buf[512], peer[INET6_ADDRSTRLEN], msg[512];
        if (recvfrom(s, buf, sizeof buf, 0, (struct sockaddr *)&a, &len) < 0)
            continue;
        peer_text(&a, peer, sizeof peer);
        int n = snprintf(msg, sizeof msg, "%s %s\n", host, peer);
        sendto(s, msg, n, 0, (struct sockaddr *)&a, len);
    }
    return NULL;
}

static void ask_once(const struct sockaddr *to, socklen_t to_len, int udp, int connect_only) {
    int s = socket(to->sa_family, udp ? SOCK_DGRAM : SOCK_STREAM, 0);
    /* connect(2) waits up to 3 s (SO_SNDTIMEO): a reject from the node can come back while
       connect still holds the socket's lock, and the kernel keeps that error soft until the
       SYN is sent again after 1 s. An answer is waited for 1 s. */
    struct timeval answer = {.tv_sec = 1}, handshake = {.tv_sec = 3};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &answer, sizeof answer);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &handshake, sizeof handshake);
    char buf[512];
    ssize_t n = -1;
    int made = connect(s, to, to_len) == 0;
    if (made && connect_only) {
        puts("connected");
        fflush(stdout);
        close(s);
        return;
    }
    if (made && (!udp || send(s, "x", 1, 0) == 1))
        n = recv(s, buf, sizeof buf - 1, 0);
    if (n > 0) {
        buf[n] = 0;
        fputs(buf, stdout);
        if (buf[n - 1] != '\n')
            putchar('\n');
    } else if (errno == ECONNREFUSED)
        puts("refused");
    else if (errno == EAGAIN || errno == EINPROGRESS || errno == ETIMEDOUT)
        puts("timeout");
    else
        printf("error %d\n", errno);
    fflush(stdout);
    close(s);
}

int main(int argc, char **argv) {
    gethostname(host, sizeof host);
    if (argc >= 3 && !strcmp(argv[1], "serve")) {
        pthread_t t;
        for (int i = 2; i < argc; i++) {
            pthread_create(&t, NULL, serve_tcp, (void *)(long)atoi(argv[i]));
            pthread_create(&t, NULL, serve_udp, (void *)(long)atoi(argv[i]));
        }
        puts("serving");
        fflush(stdout);
        for (;;)
            pause();
    }
    if (argc == 6 && !strcmp(argv[1], "ask")) {
        struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
        struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons(atoi(argv[3]))};
        int v6 = strchr(argv[2], ':') != NULL;
        if (v6 ? inet_pton(AF_INET6, argv[2], &a6.sin6_addr) != 1 : inet_pton(AF_INET, argv[2], &a4.sin_addr) != 1) {
            fprintf(stderr, "np-echo: %s is not an address\n", argv[2]);
            return 2;
        }
        const struct sockaddr *to = v6 ? (struct sockaddr *)&a6 : (struct sockaddr *)&a4;
        socklen_t len = v6 ? sizeof a6 : sizeof a4;
        for (int i = atoi(argv[5]); i > 0; i--)
            ask_once(to, len, !strcmp(argv[4], "udp"), !strcmp(argv[4], "connect"));
        return 0;
    }
    fprintf(stderr, "usage: np-echo serve PORT... | np-echo ask HOST PORT tcp|udp|connect N\n");
    return 2;
}
