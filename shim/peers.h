/*
 * peers.h: which devices the program lets reach which (shim/peers.c), and the access grants that
 * follow in the owner's pools (docs/pool.md "Peers").
 */
#ifndef MSH_PEERS_H
#define MSH_PEERS_H

/* The program enabled access from device `accessor` to the memory of device `owner` (after the
 * real call succeeded, or said it already was). From now on owner's pools grant accessor every
 * page: those mapped now (msh_pool_regrant_access) and those mapped later. */
void msh_peers_enabled(int accessor, int owner);
/* owner's pool was just made (shim/core.c, right after it is published): the peers enabled before
 * are added to its backend. */
void msh_peers_apply(int owner);

#endif
