/*
 * test_capture.c: shim/capture.c's table of open CUDA-graph captures (what every pool reads before
 * a synchronize or an unmap). An end memshim never saw the begin of (a capture begun before memshim
 * started, an end on another stream than the capture's origin, a second end) must change nothing:
 * counting it down would let the pools unmap while a real capture is still open. A table that
 * overflows keeps every pool deferring, and says so once, in words. Added for the generated
 * mutants of issue 18 (shim/capture.c#011f88b2, #02fb2d70). Its own process: the overflow case
 * leaves the table full on purpose, so it runs last.
 */
#include "harness.h"
#include "capture.h"
#include "msh.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

TEST(an_end_without_its_begin_changes_nothing)
{
    CHECK(!msh_capture_any());
    msh_capture_open(0, MSH_CAPTURE_STREAM, 0x1111);
    msh_capture_close(MSH_CAPTURE_STREAM, 0x9999); /* never opened */
    msh_capture_close(MSH_CAPTURE_TORCH, 0x1111);  /* the same token, another kind */
    CHECK(msh_capture_any());
    CHECK(msh_capture_active(0) == 1);
    CHECK(*msh_capture_counter(0) == 1);
    msh_capture_close(MSH_CAPTURE_STREAM, 0x1111);
    CHECK(!msh_capture_any());
    CHECK(msh_capture_active(0) == 0);
    msh_capture_close(MSH_CAPTURE_STREAM, 0x1111); /* a second end */
    CHECK(!msh_capture_any() && msh_capture_active(0) == 0 && *msh_capture_counter(0) == 0);
}

TEST(captures_on_two_devices_are_counted_apart)
{
    msh_capture_open(0, MSH_CAPTURE_TORCH, 1);
    msh_capture_open(1, MSH_CAPTURE_TORCH, 2);
    CHECK(msh_capture_active(0) == 1 && msh_capture_active(1) == 1 && *msh_capture_counter(1) == 2);
    msh_capture_close(MSH_CAPTURE_TORCH, 2);
    CHECK(msh_capture_active(0) == 1 && msh_capture_active(1) == 0 && msh_capture_any());
    msh_capture_close(MSH_CAPTURE_TORCH, 1);
    CHECK(!msh_capture_any());
}

TEST(a_full_table_keeps_deferring_and_says_so_once)
{
    FILE *f = tmpfile();
    REQUIRE(f);
    msh_log_set_fd(fileno(f));
    for (uint64_t t = 1; t <= 258; t++) msh_capture_open(0, MSH_CAPTURE_STREAM, t);
    for (uint64_t t = 1; t <= 258; t++) msh_capture_close(MSH_CAPTURE_STREAM, t);
    msh_log_set_fd(-1);
    char buf[4096];
    ssize_t n = pread(fileno(f), buf, sizeof buf - 1, 0);
    buf[n > 0 ? n : 0] = '\0';
    fclose(f);
    /* the two entries past the table's 256 are never closed: deferring too much is safe */
    CHECK(msh_capture_any() && msh_capture_active(0) == 2);
    const char *w = "more than 256 CUDA-graph captures open at once; device 0's pools now defer every unmap and "
                    "release for the rest of the run";
    const char *at = strstr(buf, w);
    CHECKF(at && !strstr(at + 1, w), "log: %s", buf);
}

TEST_MAIN()
