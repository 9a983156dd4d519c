/*
 * peers.c: peer access as the program asks for it. A VMM mapping is reachable only by the devices
 * named in its access descriptors (cudaDeviceEnablePeerAccess does not cover VMM memory), and a
 * descriptor per device costs every grant and unmap, so memshim grants a page to its own device
 * and to each peer the program enabled, from the moment it did. The hooks (hooks/runtime.c,
 * hooks/driver.c) report each enable; here the peer joins the owner's backend (device.h
 * add_access) and the owner's pools re-grant what they have mapped.
 *
 * It never calls a CUDA hook and never holds a lock while a pool grants.
 */
#include "peers.h"

#include <stdatomic.h>
#include <stdint.h>

#include "core.h"
#include "device.h"
#include "msh.h"
#include "pool.h"
#include "torch.h"

static _Atomic uint64_t enabled[MSH_MAX_DEVICES]; /* bit a: device a may reach device d's memory */

static void grant(int accessor, int owner)
{
    struct msh_device *dev = msh_core_device(owner);
    if (!dev || !dev->ops->add_access) return;
    int rc = dev->ops->add_access(dev, accessor);
    if (rc == EEXIST) return;
    if (rc) {
        msh_warn("device %d: cannot grant device %d access to memshim's pages (error %d): its kernels cannot "
                 "reach them", owner, accessor, rc);
        return;
    }
    struct msh_pool *p = msh_core_pool_get(owner);
    rc = p ? msh_pool_regrant_access(p) : 0;
    msh_torch_regrant_access(owner); /* the capture pools of the device */
    if (rc) msh_warn("device %d: granting device %d access to mapped pages failed (error %d)", owner, accessor, rc);
    else msh_info("device %d: its pool pages are granted to peer device %d from now on", owner, accessor);
}

void msh_peers_enabled(int accessor, int owner)
{
    if (accessor < 0 || accessor >= MSH_MAX_DEVICES || owner < 0 || owner >= MSH_MAX_DEVICES || accessor == owner)
        return;
    uint64_t bit = UINT64_C(1) << accessor;
    if (atomic_fetch_or(&enabled[owner], bit) & bit) return; /* known: granted already */
    grant(accessor, owner);
}

void msh_peers_apply(int owner)
{
    if (owner < 0 || owner >= MSH_MAX_DEVICES) return;
    uint64_t m = atomic_load(&enabled[owner]);
    for (int a = 0; a < MSH_MAX_DEVICES; a++)
        if (m & UINT64_C(1) << a) grant(a, owner);
}
